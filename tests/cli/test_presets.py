"""Engine presets (``--preset``, ``rtx presets``): the shipped files are valid for every command that takes them,
their values become the flags' defaults, flags given override them, and a bad preset is one line and exit code 2.
Nothing here loads a model."""

from __future__ import annotations

import argparse
from importlib.resources import files

import pytest

from rtxcore.cli.main import build_parser, main
from rtxcore.cli.presets import load_preset, parse_with_preset, shipped_presets
from tests.helpers import REPO

SHIPPED = sorted(shipped_presets())
# The commands that take --preset, with the positional arguments each needs to parse.
COMMANDS = {"serve": [], "generate": ["a prompt"], "bench": []}


def parse(*argv: str) -> argparse.Namespace:
    return parse_with_preset(build_parser(), list(argv))


def one_line_error(capsys: pytest.CaptureFixture[str]) -> str:
    err = capsys.readouterr().err
    lines = err.splitlines()
    assert len(lines) == 1, err
    assert "error" in lines[0] and "Traceback" not in err
    return lines[0]


def test_the_presets_the_docs_name_are_shipped():
    documented = {"llama-8b-tp2", "llama-8b-pp2", "llama-70b-tp8", "llama-70b-tp4-pp2", "smollm2-135m-tp3-cpu"}
    assert documented <= set(SHIPPED)
    # Found through the package's resources (as an installed wheel holds them), not a path into the source tree.
    assert (files("rtxcore") / "presets" / "llama-8b-tp2.toml").is_file()


@pytest.mark.parametrize("name", SHIPPED)
def test_shipped_preset_is_described_and_sets_parallel_sizes(name):
    preset = load_preset(name)
    assert preset.description.strip()
    assert "tensor_parallel_size" in preset.engine or "pipeline_parallel_size" in preset.engine


@pytest.mark.parametrize("command", COMMANDS)
@pytest.mark.parametrize("name", SHIPPED)
def test_shipped_preset_sets_the_flags_of_every_command(name, command):
    args = parse(command, *COMMANDS[command], "--preset", name)
    for key, value in load_preset(name).engine.items():
        assert getattr(args, key) == value, key


def test_preset_values_become_the_parsed_arguments():
    args = parse("serve", "--preset", "llama-70b-tp4-pp2")
    assert (args.tensor_parallel_size, args.pipeline_parallel_size) == (4, 2)
    assert (args.max_model_len, args.max_num_seqs, args.max_num_batched_tokens) == (32768, 256, 8192)
    assert (args.dtype, args.device, args.model) == ("bfloat16", "cuda", None)
    # what the preset leaves out keeps the flag's own default
    assert args.block_size == 16


def test_the_smollm2_preset_splits_the_default_model_three_ways_on_the_cpu():
    args = parse("generate", "hi", "--preset", "smollm2-135m-tp3-cpu")
    assert (args.model, args.device, args.dtype, args.tensor_parallel_size) == ("smollm2-135m", "cpu", "float32", 3)


@pytest.mark.parametrize("argv", [
    ["--preset", "llama-8b-tp2", "--tensor-parallel-size", "4", "--model", "dummy:tiny"],
    ["--tensor-parallel-size", "4", "--model", "dummy:tiny", "--preset", "llama-8b-tp2"],  # order does not matter
    ["--tensor-parallel-size=4", "--model=dummy:tiny", "--preset=llama-8b-tp2"],
])
def test_flags_on_the_command_line_override_the_preset(argv):
    args = parse("bench", *argv)
    assert (args.tensor_parallel_size, args.model) == (4, "dummy:tiny")
    assert args.max_num_batched_tokens == 8192  # not given: the preset's


def test_without_a_preset_the_flags_keep_their_defaults():
    args = parse("serve")
    assert args.preset is None
    assert (args.tensor_parallel_size, args.pipeline_parallel_size, args.max_num_batched_tokens) == (1, 1, 2048)


def test_a_preset_file_by_path(tmp_path, monkeypatch):
    preset = tmp_path / "mine.toml"
    preset.write_text('description = "mine"\n[engine]\ntensor_parallel_size = 3\nenforce_eager = true\n'
                      'kv_host_bytes = "1GiB"\nspeculative_option = ["prompt_lookup_max=3"]\n')
    args = parse("serve", "--preset", str(preset))
    assert (args.tensor_parallel_size, args.enforce_eager, args.kv_host_bytes) == (3, True, 1 << 30)
    assert args.speculative_option == [("prompt_lookup_max", 3)]
    # a relative path with a separator is a file too, not a name
    monkeypatch.chdir(tmp_path.parent)
    assert parse("serve", "--preset", f"{tmp_path.name}/mine.toml").tensor_parallel_size == 3


def test_rtx_presets_lists_every_shipped_preset_with_its_description(capsys):
    assert main(["presets"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in lines] == SHIPPED
    assert all(load_preset(name).description in line for name, line in zip(SHIPPED, lines))


def test_an_unknown_preset_name_lists_the_available_ones(capsys):
    assert main(["serve", "--preset", "llama-9000b"]) == 2
    line = one_line_error(capsys)
    assert "unknown preset 'llama-9000b'" in line
    assert all(name in line for name in SHIPPED)


@pytest.mark.parametrize("text, fragment", [
    ('[engine]\ntensor_paralel_size = 2\n', "unknown key 'tensor_paralel_size' in [engine]"),
    ('[engine]\ntensor-parallel-size = 2\n', "unknown key 'tensor-parallel-size' in [engine]"),
    ('[engin]\ntensor_parallel_size = 2\n', "unknown key 'engin'"),
    ('[engine]\ntensor_parallel_size = \n', "is not valid TOML"),
    ('description = "x"\n[engine]\ntensor_parallel_size = "two"\n', "'two' is not an integer"),
    ('[engine]\ntensor_parallel_size = 0\n', "'0' is not at least 1"),
    ('[engine]\ntensor_parallel_size = true\n', "must be a string or a number"),
    ('[engine]\nmax_num_seqs = 2.5\n', "max_num_seqs in [engine]"),
    ('[engine]\ndtype = 16\n', "must be a string"),
    ('[engine]\nenforce_eager = "yes"\n', "must be true or false"),
    ('engine = 3\n', "must be a table"),
    ('description = 3\n', "description"),
])
def test_a_bad_preset_file_is_one_line_and_exit_2(tmp_path, capsys, text, fragment):
    preset = tmp_path / "bad.toml"
    preset.write_text(text)
    assert main(["generate", "hi", "--preset", str(preset)]) == 2
    line = one_line_error(capsys)
    assert fragment in line
    assert str(preset) in line  # names the file at fault


def test_a_missing_preset_file_is_one_line_and_exit_2(tmp_path, capsys):
    assert main(["bench", "--preset", str(tmp_path / "none.toml")]) == 2
    assert "not found" in one_line_error(capsys)


def test_only_commands_that_load_a_model_take_a_preset(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["presets", "--preset", "llama-8b-tp2"])
    assert exit_info.value.code == 2
    assert "unrecognized arguments" in one_line_error(capsys)


def test_the_docs_table_agrees_with_the_shipped_files():
    rows = [line.split("|")[1:-1] for line in (REPO / "docs" / "presets.md").read_text().splitlines()
            if line.startswith("| `")]
    documented = {cells[0].strip().strip("`"): [cell.strip() for cell in cells] for cells in rows}
    assert sorted(documented) == SHIPPED
    for name, (_, _, _, sizes, dtype, max_model_len, max_num_seqs, max_num_batched_tokens) in documented.items():
        engine = load_preset(name).engine
        assert sizes == f"{engine.get('tensor_parallel_size', 1)} x {engine.get('pipeline_parallel_size', 1)}", name
        assert [dtype, max_model_len, max_num_seqs, max_num_batched_tokens] == [
            str(engine[key]) for key in ("dtype", "max_model_len", "max_num_seqs", "max_num_batched_tokens")], name
