"""The latency gate: p99 inter-token latency of a small standard workload against the target of this hardware."""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from rtx_conformance.gates.config import LatencyGate, LatencyTarget
from rtxcore.contracts.scheduler import SchedulerConfig
from rtxcore.engine.config import EngineConfig
from rtxcore.engine.llm import LLM
from rtxcore.registry import ComponentRecord, PluginRegistry
from rtxcore.sampling_params import SamplingParams

# The engine option that puts a component of each kind in place.
_ENGINE_SLOT = {"scheduler": "scheduler", "sampler": "sampler", "backend": "backend",
                "eviction_policy": "eviction_policy"}


@dataclass(frozen=True, slots=True)
class LatencyResult:
    hardware: str
    p50_itl_ms: float
    p99_itl_ms: float
    target_ms: float
    num_gaps: int

    @property
    def passed(self) -> bool:
        return self.p99_itl_ms <= self.target_ms


def device_name() -> str:
    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"


def target_for(gate: LatencyGate, device: str) -> LatencyTarget | None:
    for target in gate.targets:
        if target.device == device or (device != "cpu" and target.device != "cpu" and target.device in device):
            return target
    return None


def engine_for(record: ComponentRecord, registry: PluginRegistry, model: str, **config) -> LLM:
    """An engine with ``record`` in its slot and the built-in defaults everywhere else."""
    slot = {_ENGINE_SLOT[record.kind]: record.name}
    return LLM(EngineConfig(model=model, **slot, **config), registry=registry)


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


def run_latency(gate: LatencyGate, target: LatencyTarget, record: ComponentRecord,
                registry: PluginRegistry) -> LatencyResult:
    engine = engine_for(record, registry, gate.model, max_model_len=gate.prompt_len + gate.output_len + 16,
                        scheduling=SchedulerConfig(max_num_seqs=max(gate.num_requests, 1)))
    vocab = engine.core.model_config.vocab_size
    params = SamplingParams(max_tokens=gate.output_len, temperature=gate.temperature, top_p=gate.top_p,
                            ignore_eos=True, seed=1)
    generator = torch.Generator().manual_seed(0)

    def prompt() -> list[int]:
        return torch.randint(3, vocab, (gate.prompt_len,), generator=generator).tolist()

    if gate.num_warmup_requests:
        engine.generate([prompt() for _ in range(gate.num_warmup_requests)], params)
    last: dict[str, float] = {}
    gaps: list[float] = []
    for _ in range(gate.num_requests):
        engine.add_request(prompt(), params)
    while engine.has_unfinished_requests():
        outputs = engine.step()
        now = time.perf_counter()
        for out in outputs:
            if not out.new_token_ids:
                continue
            if out.req_id in last:
                gaps.append((now - last[out.req_id]) * 1000)
            last[out.req_id] = now
    return LatencyResult(target.hardware, percentile(gaps, 0.5), percentile(gaps, 0.99), target.p99_itl_ms,
                         len(gaps))
