"""The gate thresholds of ``spec/gates.toml``, read into dataclasses and checked once."""

from __future__ import annotations

import tomllib
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from rtxcore.errors import ConfigError
from rtxcore.spec_files import spec_path

# Package data in a wheel, spec/gates.toml in a checkout (rtxcore/spec_files.py).
DEFAULT_GATES_FILE = spec_path("gates.toml")


@dataclass(frozen=True, slots=True)
class LatencyTarget:
    hardware: str
    # "cpu", or a substring of the accelerator's name.
    device: str
    p99_itl_ms: float


@dataclass(frozen=True, slots=True)
class LatencyGate:
    kinds: tuple[str, ...]
    model: str
    num_requests: int
    prompt_len: int
    output_len: int
    temperature: float
    top_p: float
    num_warmup_requests: int
    targets: tuple[LatencyTarget, ...]


@dataclass(frozen=True, slots=True)
class CacheGate:
    kinds: tuple[str, ...]
    min_hit_rate: float
    model: str
    num_conversations: int
    num_turns: int
    min_new_tokens: int
    max_new_tokens: int
    output_len: int
    block_size: int
    kv_blocks_factor: float
    tiered_kv_blocks_factor: float
    tiered_host_blocks_factor: float
    tiered_max_num_seqs: int
    seed: int


@dataclass(frozen=True, slots=True)
class QualityGate:
    kinds: tuple[str, ...]
    num_tokens: int
    backend_max_relative_change: float
    quantizer_max_relative_increase: float
    # Calibration text given to calibrated quantizers, in tokens, and the length of each piece.
    calibration_tokens: int
    calibration_chunk_len: int
    # Registered name -> largest perplexity increase, absolute (instead of the relative bound).
    quantizer_max_ppl_increase: dict[str, float]
    # Calibrated method -> the method whose perplexity it must beat (its plain-rounding counterpart).
    quantizer_must_beat: dict[str, str]


@dataclass(frozen=True, slots=True)
class Gates:
    latency: LatencyGate
    cache: CacheGate
    quality: QualityGate

    def applies(self, gate: str, kind: str) -> bool:
        return kind in getattr(self, gate).kinds


GATE_NAMES = ("latency", "cache", "quality")


def load_gates(path: Path | None = None) -> Gates:
    path = Path(path) if path is not None else DEFAULT_GATES_FILE
    try:
        data = tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"gates file not found: {path}") from None
    except (OSError, UnicodeDecodeError) as exc:  # a directory, unreadable, not text
        raise ConfigError(f"cannot read gates file {path}: {getattr(exc, 'strerror', None) or exc}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"gates file {path} is not valid TOML: {exc}") from None
    latency = dict(_section(data, "latency", path))
    latency["targets"] = tuple(_build(LatencyTarget, t, f"{path} [[latency.targets]]")
                               for t in latency.get("targets", ()))
    return Gates(
        latency=_build(LatencyGate, latency, f"{path} [latency]"),
        cache=_build(CacheGate, _section(data, "cache", path), f"{path} [cache]"),
        quality=_build(QualityGate, _section(data, "quality", path), f"{path} [quality]"),
    )


def _section(data: dict[str, Any], name: str, path: Path) -> dict[str, Any]:
    if not isinstance(data.get(name), dict):
        raise ConfigError(f"gates file {path} has no [{name}] section")
    return data[name]


def _build(cls: type, values: dict[str, Any], where: str):
    names = {f.name for f in fields(cls)}
    missing = names - values.keys()
    unknown = values.keys() - names
    if missing or unknown:
        raise ConfigError(f"{where}: missing {sorted(missing)}, unknown {sorted(unknown)}")
    return cls(**{k: tuple(v) if isinstance(v, list) else v for k, v in values.items()})
