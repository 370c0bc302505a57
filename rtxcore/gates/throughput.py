"""The throughput gate: the engine against HF transformers eager ``generate`` with static batching, the same
requests (random-token prompts and outputs of mixed lengths, greedy, EOS ignored), tokens per second of each from
the same run: engine / baseline at least ``min_ratio`` (the seed's 1.5x)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from rtxcore.bench.engine import build_engine
from rtxcore.bench.hf_baseline import load_hf_model, run_hf_static
from rtxcore.bench.loadgen import LengthRange
from rtxcore.bench.offline import run_engine, warm_up
from rtxcore.bench.workloads import BenchRequest, Workload, make_requests
from rtxcore.engine.config import EngineConfig
from rtxcore.errors import ConfigError
from rtxcore.gates.outcome import Check
from rtxcore.gates.thresholds import require

GATE = "throughput"


@dataclass(frozen=True, slots=True)
class ThroughputSettings:
    min_ratio: float
    num_requests: int
    prompt_len: list[int]
    output_len: list[int]
    seed: int = 0

    def __post_init__(self) -> None:
        require(self.min_ratio > 0, "min_ratio", "> 0", self.min_ratio)
        for key in ("prompt_len", "output_len"):
            value = getattr(self, key)
            require(len(value) == 2, key, "[low, high]", value)
            try:
                LengthRange(*value)
            except ConfigError as exc:
                raise ConfigError(f"{key}: {exc}") from None
        most = self.workload().max_num_requests
        require(1 <= self.num_requests <= most, "num_requests", f"from 1 to {most:,} (for prompts of up to "
                f"{self.prompt_len[1]:,} tokens)", self.num_requests)

    def workload(self) -> Workload:
        (p0, p1), (o0, o1) = self.prompt_len, self.output_len
        return Workload("gates", self.num_requests, (p0, p1), (o0, o1), "")


def run(settings: ThroughputSettings, say) -> list[Check]:
    engine = build_engine(EngineConfig())
    requests = make_requests(settings.workload(), engine.core.model_config.vocab_size, settings.seed)
    say(f"throughput: the engine on {len(requests)} requests...")
    warm_up(engine, requests)
    ours = run_engine(engine, requests)
    backend: Any = engine.core.backend  # the torch backend's dtype, which the contract does not name
    device, dtype, source = backend.device, backend.dtype, engine.core.source
    del engine
    say("throughput: HF transformers eager, static batching, on the same requests...")
    model = load_hf_model(source, str(device), dtype)
    # One untimed batch first (on a GPU, on the workload's own shape: kernels are picked per shape).
    run_hf_static(model, [BenchRequest(r.prompt_token_ids, min(r.output_len, 8)) for r in requests]
                  if device.type != "cpu" else requests[:1])
    baseline = run_hf_static(model, requests)
    ratio = ours.tokens_per_s / baseline.tokens_per_s
    detail = (f"engine {ours.tokens_per_s:.1f} tok/s ({ours.elapsed_s:.1f} s), HF eager static "
              f"{baseline.tokens_per_s:.1f} tok/s ({baseline.elapsed_s:.1f} s), {ours.output_tokens} output tokens")
    return [Check(GATE, "engine / HF eager static, output tok/s", ratio, settings.min_ratio, ">=", detail)]
