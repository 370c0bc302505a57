"""The ``[phase.*]`` tables of ``spec/gates.toml``: one per gate, with per-machine-class overrides."""

from __future__ import annotations

import math
import tomllib
from dataclasses import fields
from pathlib import Path
from typing import Any, TypeVar, get_args, get_origin, get_type_hints

import torch

from rtxcore.errors import ConfigError
from rtxcore.spec_files import spec_path

# Package data in a wheel, spec/gates.toml in a checkout.
DEFAULT_GATES_FILE = spec_path("gates.toml")
MACHINE_CLASSES = ("cpu", "gpu")

T = TypeVar("T")


def machine_class() -> str:
    """"gpu" on a machine with a CUDA device, else "cpu"."""
    return "gpu" if torch.cuda.is_available() else "cpu"


def load_phase_tables(path: Path | None = None) -> dict[str, dict[str, Any]]:
    """Every ``[phase.<gate>]`` table as written (overrides still nested under their class).

    :raises ConfigError: the file is missing, unreadable or not TOML, or has no ``[phase]`` tables.
    """
    path = Path(path) if path is not None else DEFAULT_GATES_FILE
    try:
        data = tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"gates file not found: {path}") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"cannot read gates file {path}: {getattr(exc, 'strerror', None) or exc}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"gates file {path} is not valid TOML: {exc}") from None
    phase = data.get("phase")
    if not isinstance(phase, dict) or not phase:
        raise ConfigError(f"gates file {path} has no [phase.*] tables (the thresholds of `rtx gates`)")
    return phase


def settings(cls: type[T], tables: dict[str, dict[str, Any]], gate: str, machine: str) -> T:
    """``cls`` (a dataclass) from ``[phase.<gate>]`` with ``[phase.<gate>.<machine>]``'s values over it.

    :raises ConfigError: the table is missing, or has keys ``cls`` lacks, or lacks keys without a default, or a value
        of the wrong type (every number finite) or out of its range (``cls.__post_init__``), naming the key.
    """
    table = tables.get(gate)
    if not isinstance(table, dict):
        raise ConfigError(f"gates file has no [phase.{gate}] table")
    override = table.get(machine, {})
    if not isinstance(override, dict):
        raise ConfigError(f"[phase.{gate}.{machine}] must be a table, got {override!r}")
    values = {k: v for k, v in table.items() if k not in MACHINE_CLASSES}
    values.update(override)
    names = {f.name for f in fields(cls)}  # type: ignore[arg-type]
    unknown = values.keys() - names
    if unknown:
        raise ConfigError(f"[phase.{gate}] has unknown keys {sorted(unknown)}")
    hints = get_type_hints(cls)
    for key, value in values.items():
        if not _conforms(value, hints[key]):
            raise ConfigError(f"[phase.{gate}] for {machine}: {key} must be {_describe(hints[key])}, got {value!r}")
    try:
        return cls(**values)
    except (TypeError, ConfigError) as exc:
        raise ConfigError(f"[phase.{gate}] for {machine}: {exc}") from None


def require(ok: bool, key: str, expected: str, value: object) -> None:
    """One setting's range, for the settings' ``__post_init__``.

    :raises ConfigError: ``KEY must be EXPECTED, got VALUE``, unless ``ok``.
    """
    if not ok:
        raise ConfigError(f"{key} must be {expected}, got {value!r}")


def _conforms(value: Any, hint: Any) -> bool:
    """Whether a value read from TOML is of type ``hint`` (int, float, str, list[...] or dict[str, ...]); a float
    must be finite (TOML has nan and inf), and true or false is no number."""
    origin, args = get_origin(hint), get_args(hint)
    if origin is list:
        return isinstance(value, list) and all(_conforms(v, args[0]) for v in value)
    if origin is dict:
        return isinstance(value, dict) and all(_conforms(v, args[1]) for v in value.values())
    if isinstance(value, bool):
        return hint is bool
    if hint is float:
        return isinstance(value, int | float) and math.isfinite(value)
    return isinstance(value, hint)


def _describe(hint: Any, plural: bool = False) -> str:
    """``hint`` in words: "a list of integers", "a table of lists of finite numbers"."""
    origin, args = get_origin(hint), get_args(hint)
    if origin is list:
        return f"{'lists' if plural else 'a list'} of {_describe(args[0], plural=True)}"
    if origin is dict:
        return f"{'tables' if plural else 'a table'} of {_describe(args[1], plural=True)}"
    words = {int: ("an integer", "integers"), float: ("a finite number", "finite numbers"),
             str: ("a string", "strings"), bool: ("true or false", "true or false")}
    return words[hint][plural]
