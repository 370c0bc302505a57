"""Engine presets: TOML files of engine-flag values for a known model shape and GPU count (docs/presets.md).

``rtx serve|generate|bench --preset NAME_OR_FILE`` reads one before the real parse of the command line and makes its
``[engine]`` values the defaults of the command's flags, so a flag given on the command line still wins. ``rtx
presets`` lists the ones shipped in ``rtxcore/presets/``.
"""

from __future__ import annotations

import argparse
import os
import sys
import tomllib
from collections.abc import Sequence
from dataclasses import dataclass
from importlib.resources import files
from importlib.resources.abc import Traversable
from pathlib import Path
from typing import Any

from rtxcore.cli.common import add_engine_options
from rtxcore.errors import ConfigError

PRESET_SUFFIX = ".toml"
# What a preset file may hold at its top level; anything else is most likely a typo (``[engin]``) that would
# otherwise be ignored without a word.
_TOP_LEVEL_KEYS = ("description", "engine")


@dataclass(frozen=True)
class Preset:
    name: str
    description: str
    # Engine flags' dest names (tensor_parallel_size, ...) and their values, already checked by the flags' own
    # types, as the command line would have given them.
    engine: dict[str, Any]
    # Where it was read from, for messages.
    source: str


def shipped_presets() -> dict[str, Traversable]:
    """The presets installed with the package (``rtxcore/presets/*.toml``), by name (the file name without .toml)."""
    folder = files("rtxcore") / "presets"
    if not folder.is_dir():
        return {}
    return {entry.name.removesuffix(PRESET_SUFFIX): entry for entry in folder.iterdir()
            if entry.name.endswith(PRESET_SUFFIX) and entry.is_file()}


def is_preset_file(spec: str) -> bool:
    """Whether ``--preset`` names a file rather than a shipped preset."""
    separators = [sep for sep in ("/", os.sep, os.altsep) if sep]
    return spec.endswith(PRESET_SUFFIX) or any(sep in spec for sep in separators)


def load_preset(spec: str) -> Preset:
    """The preset ``spec`` names: a shipped one by name, or a .toml file (a name ending in .toml or with a path
    separator). Raises ConfigError, with one line a user can act on, for anything wrong with it."""
    if is_preset_file(spec):
        path = Path(spec).expanduser()
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            raise ConfigError(f"preset file {spec!r} not found") from None
        except OSError as exc:
            raise ConfigError(f"cannot read preset file {spec!r}: {exc.strerror or exc}") from None
        return parse_preset(path.stem, data, spec)
    shipped = shipped_presets()
    if spec not in shipped:
        raise ConfigError(f"unknown preset {spec!r}; available: {', '.join(sorted(shipped)) or 'none'} "
                          f"(or give a path to a {PRESET_SUFFIX} file)")
    return parse_preset(spec, shipped[spec].read_bytes(), str(shipped[spec]))


def parse_preset(name: str, data: bytes, source: str) -> Preset:
    try:
        table = tomllib.loads(data.decode())
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"preset {source} is not valid TOML: {exc}") from None
    for key in table:
        if key not in _TOP_LEVEL_KEYS:
            raise ConfigError(f"unknown key {key!r} in preset {source}; a preset has a description and an [engine] "
                              "table")
    description = table.get("description", "")
    if not isinstance(description, str):
        raise ConfigError(f"description in preset {source} must be a string, got {description!r}")
    engine = table.get("engine", {})
    if not isinstance(engine, dict):
        raise ConfigError(f"engine in preset {source} must be a table ([engine]), got {engine!r}")
    flags = engine_flags()
    values = {}
    for key, value in engine.items():
        if key not in flags:
            raise ConfigError(f"unknown key {key!r} in [engine] of preset {source}; keys are the engine flags' "
                              "names with underscores, e.g. tensor_parallel_size for --tensor-parallel-size")
        values[key] = _flag_value(flags[key], value, f"{key} in [engine] of preset {source}")
    return Preset(name, description, values, source)


def engine_flags() -> dict[str, argparse.Action]:
    """The engine flags of every command that loads a model (rtxcore.cli.common), by dest name: only those, so a
    preset means the same to serve, generate and bench. The positional MODEL is --model's other spelling, not a key
    of its own."""
    parser = argparse.ArgumentParser(add_help=False)
    add_engine_options(parser)
    # argparse has no public list of its actions
    return {action.dest: action for action in parser._actions if action.option_strings}


def _flag_value(flag: argparse.Action, value: Any, where: str) -> Any:
    """``value`` as ``flag`` would take it from the command line, through the flag's own type (positive_int,
    byte_size, ...), so that a preset cannot set what the flag itself refuses."""
    if flag.nargs == 0:  # a switch, such as --enforce-eager
        if not isinstance(value, bool):
            raise ConfigError(f"{where} must be true or false, got {value!r}")
        return value
    if isinstance(flag, argparse._AppendAction):  # a repeatable flag: a list of what each use of it takes
        if not isinstance(value, list):
            raise ConfigError(f"{where} must be a list, got {value!r}")
        return [_one_value(flag, item, where) for item in value]
    return _one_value(flag, value, where)


def _one_value(flag: argparse.Action, value: Any, where: str) -> Any:
    # bool is an int to Python; a number flag given true is a mistake, not 1.
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        raise ConfigError(f"{where} must be a string or a number, got {value!r}")
    if flag.type is None:
        if not isinstance(value, str):
            raise ConfigError(f"{where} must be a string, got {value!r}")
        result: Any = value
    else:
        convert: Any = flag.type
        try:
            result = convert(str(value))
        except argparse.ArgumentTypeError as exc:
            raise ConfigError(f"{where}: {exc}") from None
        except (TypeError, ValueError):
            kind = getattr(convert, "__name__", "value")
            raise ConfigError(f"{where} must be a valid {kind}, got {value!r}") from None
    if flag.choices is not None and result not in flag.choices:
        raise ConfigError(f"{where} must be one of {', '.join(map(str, flag.choices))}, got {value!r}")
    return result


def add_preset_option(command: argparse.ArgumentParser) -> None:
    command.add_argument("--preset", default=None, metavar="NAME_OR_FILE",
                         help="engine settings for a known model shape and GPU count: a name `rtx presets` lists, "
                              "or a .toml file; flags given on the command line override it (docs/presets.md)")


def add_preset_option_to_engine_commands(sub: argparse._SubParsersAction) -> None:
    """Give ``--preset`` to every command that has the engine flags (serve, generate, bench, and any added later)."""
    engine_dests = set(engine_flags())
    for command in sub.choices.values():
        if engine_dests <= {action.dest for action in command._actions}:
            add_preset_option(command)


def parse_with_preset(parser: argparse.ArgumentParser, argv: Sequence[str] | None = None) -> argparse.Namespace:
    """``parser.parse_args(argv)``, with the engine flags of the chosen command defaulting to the values of its
    ``--preset``, if it has one. A first parse finds the command and the preset (argparse's own rules: ``--preset=X``,
    abbreviations, ``--``), the preset becomes the command's defaults, and the real parse then lets every flag given
    override them."""
    first, _ = parser.parse_known_args(argv)
    spec = getattr(first, "preset", None)
    if spec is not None:
        preset = load_preset(spec)
        _command_parser(parser, first.command).set_defaults(**preset.engine)
    return parser.parse_args(argv)


def _command_parser(parser: argparse.ArgumentParser, command: str) -> argparse.ArgumentParser:
    for action in parser._actions:  # argparse has no public way to get a subcommand's parser back
        if isinstance(action, argparse._SubParsersAction):
            return action.choices[command]
    raise LookupError(f"no subcommand {command!r}")


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("presets", help="list the engine presets --preset takes by name",
                       description="List the engine presets shipped with rtx-serve (docs/presets.md). "
                                   "`rtx serve|generate|bench --preset NAME` uses one.")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    presets = [load_preset(name) for name in sorted(shipped_presets())]
    width = max((len(preset.name) for preset in presets), default=0)
    for preset in presets:
        sys.stdout.write(f"{preset.name:<{width}}  {preset.description}\n")
    return 0
