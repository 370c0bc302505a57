"""Where the host's time goes while the engine drives the GPU: cProfile over the engine's steps on ``dummy:llama-1b``.

- ``w3``: one stream (prompt 128, 256 tokens) after a warm-up run of the same shape; CUDA graphs and asynchronous
  scheduling as in ``rtx bench``. A decode step is host-bound when this Python takes longer than a graph replay.
- ``w2`` (``w2_64``): W2's requests with 32 (64) running at most (its first 1,500 steps after a warm-up), where
  the steps that carry a newcomer's prefill replay piecewise graphs and launch attention from Python.

Usage: python benchmarks/host_profile.py [w3] [w2] [w2_64]   (prints the top functions by own and by cumulative time)
"""

from __future__ import annotations

import cProfile
import io
import pstats
import sys
import time

import torch

from rtxcore.bench.workloads import make_requests
from rtxcore.contracts.scheduler import SchedulerConfig
from rtxcore.engine.config import EngineConfig
from rtxcore.engine.llm_engine import LLMEngine
from rtxcore.sampling_params import SamplingParams


def _engine(max_num_seqs: int) -> LLMEngine:
    return LLMEngine(EngineConfig(model="dummy:llama-1b", device="cuda", dtype="bfloat16", max_model_len=4096,
                                  scheduling=SchedulerConfig(max_num_batched_tokens=8192, max_num_seqs=max_num_seqs)))


def _report(label: str, profiler: cProfile.Profile, elapsed: float, steps: int) -> None:
    print(f"\n=== {label}: {steps} steps in {elapsed * 1000:.1f} ms ({elapsed * 1000 / steps:.3f} ms per step) ===")
    for key in ("tottime", "cumulative"):
        text = io.StringIO()
        pstats.Stats(profiler, stream=text).sort_stats(key).print_stats(28)
        print(text.getvalue().split("\n", 6)[-1])


def _run(engine: LLMEngine, requests, max_steps: int | None = None) -> int:
    for prompt, params in requests:
        engine.add_request(prompt, params)
    steps = 0
    while engine.has_unfinished_requests() and (max_steps is None or steps < max_steps):
        engine.step()
        steps += 1
    return steps


def _drain(engine: LLMEngine) -> None:
    while engine.has_unfinished_requests():
        engine.step()


def w3() -> None:
    engine = _engine(1)
    params = SamplingParams(max_tokens=256, temperature=0.0, ignore_eos=True)
    request = [([1000 + j * 7 % 5000 for j in range(128)], params)]
    _run(engine, request)
    torch.cuda.synchronize()
    profiler = cProfile.Profile()
    start = time.perf_counter()
    profiler.enable()
    steps = _run(engine, request)
    torch.cuda.synchronize()
    profiler.disable()
    _report("W3, one stream", profiler, time.perf_counter() - start, steps)


def w2(max_num_seqs: int = 32) -> None:
    engine = _engine(max_num_seqs)
    requests = [(r.prompt_token_ids, SamplingParams(max_tokens=r.output_len, temperature=0.0, ignore_eos=True))
                for r in make_requests("W2", engine.model_config.vocab_size, seed=0)]
    _run(engine, requests[:64])
    torch.cuda.synchronize()
    profiler = cProfile.Profile()
    start = time.perf_counter()
    profiler.enable()
    steps = _run(engine, requests, max_steps=1500)
    torch.cuda.synchronize()
    profiler.disable()
    _report(f"W2, {max_num_seqs} running", profiler, time.perf_counter() - start, steps)
    _drain(engine)


if __name__ == "__main__":
    for what in sys.argv[1:] or ["w3", "w2"]:
        {"w3": w3, "w2": w2, "w2_64": lambda: w2(64)}[what]()
