"""Speculative decoding on the command line: the flags of serve, generate and bench, the config file's
``[speculative]`` table under them, one-line errors with exit code 2, and the summaries' acceptance figures."""

from __future__ import annotations

import json

import pytest

from rtxcore.cli.common import engine_cli_args, engine_config
from rtxcore.cli.main import build_parser
from rtxcore.cli.speculation import option_value
from rtxcore.engine.speculation.config import SpeculativeConfig
from rtxcore.server.serve_config import load_serve_config
from tests.helpers.cli import assert_config_file_error, assert_one_line_error, config_file, rtx, run_in_process

AVAILABLE = "(available: assisted, draft, layer-skip, ngram)"

FILE = """
[speculative]
method = "ngram"
num_speculative_tokens = 6
adaptive = false
min_acceptance = 0.2
disable_batch_size = false
grammar_proposals = false

[speculative.options]
prompt_lookup_max = 3
"""


def speculative(*argv: str, file: str | None = None) -> SpeculativeConfig:
    args = build_parser().parse_args(["serve", *argv])
    return engine_config(args, load_serve_config(file)).speculative


@pytest.mark.parametrize("command", ["generate", "serve", "bench"])
def test_unknown_method_lists_the_registered_ones(command):
    args = ["generate", "hi"] if command == "generate" else [command]
    assert_one_line_error(rtx(*args, "--model", "dummy:tiny", "--speculative", "medusa"),
                          f"--speculative: no proposer named 'medusa' is registered {AVAILABLE}")


@pytest.mark.parametrize("args, fragment", [
    (["--num-speculative-tokens", "0"], "argument --num-speculative-tokens: '0' is not in [1, 16]"),
    (["--num-speculative-tokens", "17"], "argument --num-speculative-tokens: '17' is not in [1, 16]"),
    (["--num-speculative-tokens", "four"], "argument --num-speculative-tokens: 'four' is not an integer"),
    (["--speculative-option", "layers"], "argument --speculative-option: 'layers' is not KEY=VALUE"),
    (["--grammar-proposals", "yes"], "argument --grammar-proposals: invalid choice: 'yes'"),
    (["--speculative-option", "=3"], "argument --speculative-option: '=3' is not KEY=VALUE"),
    (["--speculative-option", "layers="], "argument --speculative-option: 'layers=' has no value"),
    (["--draft-model", "dummy:tiny"], "--draft-model sets an option of a proposer: it needs --speculative METHOD"),
    (["--speculative-option", "k=1"], "--speculative-option sets an option of a proposer: it needs --speculative"),
    (["--speculative", "draft", "--draft-model", "a", "--speculative-option", "draft_model=b"],
     "--draft-model and --speculative-option draft_model=... name different models"),
])
@pytest.mark.parametrize("command", ["generate", "bench"])
def test_bad_flags_one_line_exit_2(command, args, fragment):
    prefix = ["generate", "hi"] if command == "generate" else [command]
    assert_one_line_error(run_in_process(*prefix, "--model", "dummy:tiny", *args), fragment)


@pytest.mark.parametrize("args, fragment", [
    (["--speculative", "ngram", "--speculative-option", "prompt_lookup_min=many"],
     "ngram option prompt_lookup_min must be an integer, got 'many'"),
    (["--speculative", "draft"], "the draft proposer needs a draft model: --draft-model NAME"),
])
@pytest.mark.parametrize("command", ["generate", "bench"])
def test_a_proposers_own_check_is_the_last_line_before_anything_is_generated(command, args, fragment):
    # The plugin checks its options as the engine builds it, once the target's weights are in (a proposer reads the
    # target's shape): the loading lines come first.
    prefix = ["generate", "hi"] if command == "generate" else [command]
    assert_one_line_error(run_in_process(*prefix, "--model", "dummy:tiny", *args), fragment, after_progress=True)


@pytest.mark.parametrize("text, fragment", [
    ('[speculative]\nmethod = "medusa"\n', f"[speculative] method in {{path}}: no proposer named 'medusa' is "
                                           f"registered {AVAILABLE}"),
    ("[speculative]\nnum_speculative_tokens = 0\n", "[speculative] in {path}: num_speculative_tokens must be in "
                                                    "[1, 16], got 0"),
    ("[speculative]\nnum_speculative_tokens = 4.5\n", "[speculative] num_speculative_tokens in {path} must be an "
                                                      "integer, got 4.5"),
    ('[speculative]\nadaptive = "yes"\n', "[speculative] adaptive in {path} must be true or false, got 'yes'"),
    ("[speculative]\ndisable_batch_size = true\n", "disable_batch_size in {path} must be an integer or false"),
    ("[speculative]\nmin_acceptance = 1.5\n", "min_acceptance must be in [0, 1), got 1.5"),
    ("[speculative]\noptions = 3\n", "[speculative] options in {path} must be a table"),
    ("[speculative]\nk = 3\n", "unknown setting 'k' in [speculative] of {path}"),
    ("[speculative]\ngrammar_proposals = 1\n", "[speculative] grammar_proposals in {path} must be true or false"),
    ("speculative = 3\n", "[speculative] in {path} must be a table"),
])
def test_bad_config_file_one_line_exit_2(tmp_path, text, fragment):
    assert_config_file_error(tmp_path, text, fragment)


def test_no_config_file_no_table():
    assert load_serve_config(None).speculative is None


def test_config_file_settings(tmp_path):
    path = config_file(tmp_path, FILE)
    assert load_serve_config(path).speculative == SpeculativeConfig(
        method="ngram", num_speculative_tokens=6, adaptive=False, min_acceptance=0.2, disable_batch_size=None,
        grammar_proposals=False, options={"prompt_lookup_max": 3})
    # Without flags the file's settings reach the engine as they are.
    assert speculative(file=path) == load_serve_config(path).speculative


def test_flags_override_the_file(tmp_path):
    path = config_file(tmp_path, FILE)
    spec = speculative("--num-speculative-tokens", "3", "--speculative-option", "prompt_lookup_min=2", file=path)
    assert (spec.method, spec.num_speculative_tokens, spec.adaptive) == ("ngram", 3, False)
    # Options merge key by key, the flag's winning; what the flags do not name stays the file's.
    assert spec.options == {"prompt_lookup_max": 3, "prompt_lookup_min": 2}
    assert (spec.min_acceptance, spec.disable_batch_size, spec.grammar_proposals) == (0.2, None, False)
    assert speculative("--grammar-proposals", "on", file=path).grammar_proposals is True
    assert speculative("--grammar-proposals", "auto", file=path).grammar_proposals is None
    assert speculative("--speculative-option", "prompt_lookup_max=5", file=path).options == {"prompt_lookup_max": 5}
    # Another method: the file's options were the file's method's.
    other = speculative("--speculative", "layer-skip", "--speculative-option", "exit_layer=1", file=path)
    assert (other.method, other.options) == ("layer-skip", {"exit_layer": 1})


def test_flags_without_a_file():
    assert speculative() == SpeculativeConfig()
    spec = speculative("--speculative", "draft", "--draft-model", "dummy:tiny", "--num-speculative-tokens", "16",
                       "--no-speculative-adaptive", "--speculative-option", "num_kv_blocks=64")
    assert spec == SpeculativeConfig(method="draft", num_speculative_tokens=16, adaptive=False,
                                     options={"draft_model": "dummy:tiny", "num_kv_blocks": 64})
    # The same model twice is no contradiction.
    assert speculative("--speculative", "draft", "--draft-model", "m", "--speculative-option",
                       "draft_model=m").options == {"draft_model": "m"}


@pytest.mark.parametrize("text, value", [
    ("3", 3), ("-2", -2), ("0.5", 0.5), ("1e-3", 0.001), ("true", True), ("False", False),
    ("0-11,15", "0-11,15"), ("dummy:llama-1b", "dummy:llama-1b"), ("nan", "nan"), ("inf", "inf"),
])
def test_option_values(text, value):
    parsed = option_value(text)
    assert parsed == value and type(parsed) is type(value)


def test_server_started_by_bench_gets_the_same_settings():
    """``rtx bench --serve`` starts ``rtx serve`` with engine_cli_args: the speculative flags must survive."""
    argv = ["--speculative", "ngram", "--num-speculative-tokens", "7", "--no-speculative-adaptive",
            "--grammar-proposals", "off", "--speculative-option", "prompt_lookup_max=2", "--speculative-option",
            "flag=true"]
    bench = build_parser().parse_args(["bench", *argv])
    served = build_parser().parse_args(["serve", *engine_cli_args(bench)])
    assert engine_config(served).speculative == engine_config(bench).speculative
    assert engine_config(served).speculative.options == {"prompt_lookup_max": 2, "flag": True}
    assert engine_config(served).speculative.grammar_proposals is False


def test_bench_reports_acceptance(tmp_path):
    out = tmp_path / "bench.json"
    proc = rtx("bench", "--model", "dummy:tiny", "--device", "cpu", "--num-requests", "2", "--speculative", "ngram",
               "--json", str(out))
    assert proc.returncode == 0, proc.stderr
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("rtx engine: speculative ngram: "))
    assert "acceptance rate" in line and "mean accepted length" in line
    spec = json.loads(out.read_text())["speculative"]
    assert spec["method"] == "ngram" and spec["num_verifications"] > 0
    assert 0 < spec["acceptance_rate"] <= 1
    assert spec["mean_accepted_length"] == pytest.approx(1 + spec["num_accepted_tokens"] / spec["num_verifications"])


def test_bench_without_speculation_reports_none(tmp_path):
    out = tmp_path / "bench.json"
    proc = rtx("bench", "--model", "dummy:tiny", "--device", "cpu", "--num-requests", "1", "--json", str(out))
    assert proc.returncode == 0, proc.stderr
    assert "speculative" not in proc.stdout.split("\n", 1)[1]  # the first line is the command
    assert json.loads(out.read_text())["speculative"] is None


@pytest.mark.model
def test_generate_prints_the_acceptance_line():
    proc = rtx("generate", "Repeat exactly: the quick brown fox jumps over the lazy dog. Repeat exactly: the quick",
               "--max-tokens", "16", "--speculative", "ngram", "--temperature", "0")
    assert proc.returncode == 0, proc.stderr
    line = next(ln for ln in proc.stderr.splitlines() if ln.startswith("[speculative ngram: "))
    assert "acceptance rate" in line and "mean accepted length" in line
