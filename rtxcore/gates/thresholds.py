"""The ``[phase.*]`` tables of ``spec/gates.toml``: one per gate, with per-machine-class overrides."""

from __future__ import annotations

import tomllib
from dataclasses import fields
from pathlib import Path
from typing import Any, TypeVar

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

    :raises ConfigError: the table is missing, or has keys ``cls`` lacks, or lacks keys without a default.
    """
    table = tables.get(gate)
    if not isinstance(table, dict):
        raise ConfigError(f"gates file has no [phase.{gate}] table")
    values = {k: v for k, v in table.items() if k not in MACHINE_CLASSES}
    values.update(table.get(machine, {}))
    names = {f.name for f in fields(cls)}  # type: ignore[arg-type]
    unknown = values.keys() - names
    if unknown:
        raise ConfigError(f"[phase.{gate}] has unknown keys {sorted(unknown)}")
    try:
        return cls(**values)
    except TypeError as exc:
        raise ConfigError(f"[phase.{gate}] for {machine}: {exc}") from None
