"""The cache gate: the prefix-cache hit rate of a steady multi-turn workload (W4, scaled down: the conformance
suite's cache gate, ``[cache]`` of spec/gates.toml) with the built-in scheduler and eviction policy, once with a
device cache that holds every conversation and once with one too small for them over a host-memory tier; both at
least ``min_hit_rate`` (the seed's 85%). The small cache without the host tier is reported beside them."""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

from rtx_conformance.gates.cache import run_cache
from rtx_conformance.gates.config import load_gates
from rtxcore.engine.config import EngineConfig
from rtxcore.gates.outcome import Check
from rtxcore.gates.thresholds import require
from rtxcore.registry import load_plugins

GATE = "cache"


@dataclass(frozen=True, slots=True)
class CacheSettings:
    min_hit_rate: float

    def __post_init__(self) -> None:
        require(0 <= self.min_hit_rate <= 1, "min_hit_rate", "from 0 to 1", self.min_hit_rate)


def run(settings: CacheSettings, gates_file: Path | None, say) -> list[Check]:
    workload = replace(load_gates(gates_file).cache, min_hit_rate=settings.min_hit_rate)
    registry = load_plugins()
    defaults = EngineConfig()  # the scheduler in its slot; the default eviction policy and the rest beside it
    say(f"cache: {workload.num_conversations} conversations x {workload.num_turns} turns ({defaults.scheduler} "
        f"scheduler, {defaults.eviction_policy} eviction)...")
    result = run_cache(workload, registry.get("scheduler", defaults.scheduler), registry)
    detail = (f"{result.num_cached_tokens}/{result.num_prompt_tokens} prompt tokens cached with {result.num_kv_blocks} "
              f"blocks; the {result.tiered_kv_blocks}-block cache without the host tier: "
              f"{result.no_offload_hit_rate:.3f}")
    return [Check(GATE, "hit rate, roomy device cache", result.hit_rate, settings.min_hit_rate, ">=", detail),
            Check(GATE, "hit rate, small device cache + host tier", result.tiered_hit_rate, settings.min_hit_rate,
                  ">=", detail)]
