"""``--logits-processor-option NAME.KEY=VALUE`` and the config file's ``[logits_processors.NAME]``: the settings reach
the processor's context, the flag wins over the file, and what a processor does not take is a one-line error."""

from __future__ import annotations

import pytest

from rtxcore.cli.common import engine_cli_args, engine_config
from rtxcore.cli.main import build_parser
from rtxcore.engine.config import EngineConfig
from rtxcore.engine.llm import LLM
from rtxcore.server.serve_config import load_serve_config
from tests.helpers.cli import assert_config_file_error, assert_one_line_error, config_file, run_in_process

INSTALLED = "(installed: allowed_tokens, banned_tokens, logit_bias, min_tokens, structured_output)"


def options(*argv: str, file: str | None = None) -> dict:
    args = build_parser().parse_args(["serve", *argv])
    return engine_config(args, load_serve_config(file)).logits_processor_options


@pytest.mark.parametrize("args, fragment", [
    (["--logits-processor-option", "mask_threads=2"], "argument --logits-processor-option: 'mask_threads=2' is not "
                                                       "NAME.KEY=VALUE"),
    (["--logits-processor-option", "structured_output.mask_threads"], "is not KEY=VALUE"),
    (["--logits-processor-option", "grammar.x=1"], f"logits processor options for 'grammar': no logits processor "
                                                   f"of that name is installed {INSTALLED}"),
    (["--logits-processor-option", "structured_output.threads=2"],
     "unknown structured_output option 'threads' (options: mask_threads)"),
    (["--logits-processor-option", "logit_bias.scale=2"], "unknown logit_bias option 'scale' (options: none)"),
])
@pytest.mark.parametrize("command", ["generate", "bench"])
def test_bad_options_one_line_exit_2(command, args, fragment):
    prefix = ["generate", "hi"] if command == "generate" else [command]
    assert_one_line_error(run_in_process(*prefix, "--model", "dummy:tiny", *args), fragment)


@pytest.mark.parametrize("value, shown", [("0", "0"), ("many", "'many'")])
@pytest.mark.parametrize("command", ["generate", "bench"])
def test_a_processors_own_check_of_a_value_is_the_last_line(command, value, shown):
    # The processor checks its values as the engine builds it, once the weights are in (it reads the model's
    # vocabulary and device): the loading lines come first.
    prefix = ["generate", "hi"] if command == "generate" else [command]
    proc = run_in_process(*prefix, "--model", "dummy:tiny", "--logits-processor-option",
                          f"structured_output.mask_threads={value}")
    assert_one_line_error(proc, f"structured_output option mask_threads must be a positive integer, got {shown}",
                          after_progress=True)


def test_the_flag_wins_over_the_file_key_by_key(tmp_path):
    path = config_file(tmp_path, "[logits_processors.structured_output]\nmask_threads = 3\n")
    assert options(file=path) == {"structured_output": {"mask_threads": 3}}
    assert options("--logits-processor-option", "structured_output.mask_threads=5", file=path) == {
        "structured_output": {"mask_threads": 5}}
    assert options() == {}


@pytest.mark.parametrize("text, fragment", [
    ("[logits_processors]\nstructured_output = 3\n", "[logits_processors] structured_output in {path} must be a "
                                                     "table"),
    ("logits_processors = 3\n", "[logits_processors] in {path} must be a table"),
    ("[logits_processors.structured_output]\nthreads = 2\n", "unknown structured_output option 'threads'"),
])
def test_bad_config_file_one_line_exit_2(tmp_path, text, fragment):
    assert_config_file_error(tmp_path, text, fragment)


def test_the_options_reach_the_processor_and_only_it():
    engine = LLM(EngineConfig(model="dummy:tiny", logits_processor_options={"structured_output": {"mask_threads": 3}}))
    processors = engine.core.logits.processors
    assert processors["structured_output"].context.options == {"mask_threads": 3}
    assert processors["structured_output"].mask_threads == 3
    assert processors["logit_bias"].context.options == {}
    on_cpu = LLM(EngineConfig(model="dummy:tiny", device="cpu")).core.logits.processors["structured_output"]
    assert on_cpu.mask_threads == 1, "a CPU's cores are the model's: one thread fills the masks by default"


def test_serve_is_started_again_with_the_same_options():
    args = build_parser().parse_args(["serve", "--logits-processor-option", "structured_output.mask_threads=4"])
    argv = engine_cli_args(args)
    assert argv[argv.index("--logits-processor-option") + 1] == "structured_output.mask_threads=4"
    assert engine_config(build_parser().parse_args(["serve", *argv])).logits_processor_options == {
        "structured_output": {"mask_threads": 4}}
