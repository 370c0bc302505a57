"""The flags vLLM users know: the model as a positional argument, defaults in every help, one temperature default
for the command line and the API."""

from __future__ import annotations

import argparse
from collections.abc import Iterator

import httpx
import pytest

from rtxcore.cli.main import build_parser, main
from rtxcore.sampling_params import SamplingParams
from tests.helpers.cli import assert_one_line_error, rtx
from tests.helpers.server import start_server


def parse(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(list(argv))


@pytest.mark.parametrize("argv, model, prompt", [
    (["generate", "hi"], None, "hi"),
    (["generate", "dummy:tiny", "hi"], "dummy:tiny", "hi"),
    (["generate", "dummy:tiny", "--max-tokens", "4", "hi"], "dummy:tiny", "hi"),  # options between the two
    (["generate", "--max-tokens", "4", "dummy:tiny", "hi"], "dummy:tiny", "hi"),
    (["generate", "hi", "--model", "dummy:tiny"], "dummy:tiny", "hi"),
    (["generate", "dummy:tiny", "hi", "--model", "dummy:tiny"], "dummy:tiny", "hi"),  # both, the same: fine
])
def test_generate_takes_model_then_prompt(argv, model, prompt):
    args = parse(*argv)
    assert (args.model, args.prompt) == (model, prompt)
    assert not hasattr(args, "model_arg")


@pytest.mark.parametrize("command", ["serve", "chat", "bench"])
def test_model_is_positional_where_a_model_loads(command):
    assert parse(command, "dummy:tiny").model == "dummy:tiny"
    assert parse(command, "--model", "dummy:tiny").model == "dummy:tiny"
    assert parse(command, "--max-num-seqs", "4", "dummy:tiny").model == "dummy:tiny"
    assert parse(command).model is None


def test_a_positional_model_overrides_a_presets(tmp_path):
    preset = tmp_path / "p.toml"
    preset.write_text('[engine]\nmodel = "dummy:llama-1b"\n')
    from rtxcore.cli.presets import parse_with_preset

    assert parse_with_preset(build_parser(), ["serve", "--preset", str(preset)]).model == "dummy:llama-1b"
    assert parse_with_preset(build_parser(), ["serve", "dummy:tiny", "--preset", str(preset)]).model == "dummy:tiny"


@pytest.mark.parametrize("argv", [["serve", "dummy:tiny", "--model", "dummy:llama-1b"],
                                  ["generate", "--model", "dummy:llama-1b", "dummy:tiny", "hi"]])
def test_two_different_models_are_a_usage_error(argv):
    assert_one_line_error(rtx(*argv), "two models given, 'dummy:tiny' and --model 'dummy:llama-1b'")


@pytest.mark.model
def test_generate_runs_the_positional_model(default_model_file):
    proc = rtx("generate", str(default_model_file), "The capital of France is", "--max-tokens", "8",
               "--temperature", "0")
    assert proc.returncode == 0, proc.stderr
    assert f"loading {default_model_file} on backend" in proc.stderr
    assert "Paris" in proc.stdout


def test_serve_serves_the_positional_model():
    with start_server("dummy:tiny", "--no-grpc", "--device", "cpu", "--num-kv-blocks", "64") as server:
        with httpx.Client(base_url=server.base_url, timeout=60) as http:
            done = http.post("/v1/completions", json={"model": "dummy:tiny", "prompt": [1, 2, 3], "max_tokens": 2})
    assert done.status_code == 200, done.text
    assert done.json()["usage"]["completion_tokens"] == 2


def test_temperature_defaults_to_the_apis():
    assert parse("generate", "hi").temperature == SamplingParams().temperature == 1.0
    assert parse("chat").temperature == SamplingParams().temperature


def _parsers(parser: argparse.ArgumentParser, name: str = "rtx") -> Iterator[tuple[str, argparse.ArgumentParser]]:
    yield name, parser
    for action in parser._actions:  # argparse has no public way to reach the subcommands' parsers
        if isinstance(action, argparse._SubParsersAction):
            for command, sub in action.choices.items():
                yield from _parsers(sub, f"{name} {command}")


def test_every_help_shows_defaults_once_and_no_none():
    for name, parser in _parsers(build_parser()):
        text = parser.format_help()
        assert "(default: None)" not in text and "(default: False)" not in text, name
        formatter = parser._get_formatter()
        for action in parser._actions:
            if (not action.option_strings or action.nargs == 0 or action.default in (None, [], argparse.SUPPRESS)
                    or not action.help):  # argparse prints nothing at all for an option without help
                continue
            shown = formatter._expand_help(action)
            where = f"{name} {action.option_strings[0]}: {shown!r}"
            assert "default" in shown.lower() and shown.count("(default:") <= 1, where


def test_generate_help_gives_the_model_rule_and_defaults(capsys):
    with pytest.raises(SystemExit) as done:
        main(["generate", "--help"])
    assert done.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "usage: rtx generate [options] [MODEL] PROMPT" in text
    assert "two are the model and the prompt" in text
    assert "0 for greedy (default: 1.0" in text
    assert "(default: 128)" in text and "(default: torch)" in text
