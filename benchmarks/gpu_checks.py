"""Correctness and step-time checks of the torch backend on a CUDA GPU (run by benchmarks/gpu_bench.sh).

1. Greedy tokens of the default model's shape with random weights (float32) on the GPU, with CUDA graphs and
   eagerly, equal the CPU path's for the first 32 tokens of each prompt.
2. Where a decode step's time goes on ``dummy:llama-1b`` (bfloat16): one graph replay timed with CUDA events, against
   the whole engine step timed on the host, at batch 1 and 256.
Usage: python benchmarks/gpu_checks.py OUT.json
"""

from __future__ import annotations

import json
import sys
import time

import torch

from rtxcore.contracts.scheduler import SchedulerConfig
from rtxcore.engine.config import EngineConfig
from rtxcore.engine.llm_engine import LLMEngine
from rtxcore.sampling_params import SamplingParams


def engine(model: str, device: str, dtype: str, eager: bool = False, **sched) -> LLMEngine:
    return LLMEngine(EngineConfig(model=model, device=device, dtype=dtype, enforce_eager=eager,
                                  max_model_len=4096, scheduling=SchedulerConfig(**sched)))


def greedy_equality() -> dict:
    params = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    prompts = [[100 + (i * 37 + j * 11) % 40000 for j in range(20 + 7 * i)] for i in range(6)]
    runs = {}
    for label, device, eager in (("cpu", "cpu", True), ("cuda graphs", "cuda", False), ("cuda eager", "cuda", True)):
        e = engine("dummy:smollm2-135m", device, "float32", eager)
        runs[label] = [r.token_ids for r in e.generate(prompts, params)]
    out = {}
    for label, toks in runs.items():
        if label == "cpu":
            continue
        out[label] = [a == b for a, b in zip(runs["cpu"], toks)]
        first_diff = [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
                      for a, b in zip(runs["cpu"], toks)]
        print(f"greedy {label} == cpu: {out[label]} (first differing token: {first_diff})", flush=True)
    return out


def step_times() -> dict:
    e = engine("dummy:llama-1b", "cuda", "bfloat16", max_num_batched_tokens=8192, max_num_seqs=256)
    graphs = e.backend._graphs
    out = {}
    for batch in (1, 256):
        params = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
        for i in range(batch):
            e.add_request([1000 + (i * 7 + j) % 5000 for j in range(128)], params)
        for _ in range(12):
            e.step()  # prefill, then decodes
        torch.cuda.synchronize()
        host = []
        for _ in range(32):
            t = time.perf_counter()
            e.step()
            host.append(time.perf_counter() - t)
        while e.has_unfinished_requests():
            e.step()
        size = next(s for s in graphs.sizes if s >= batch)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        for _ in range(5):
            graphs._graphs[size].replay()
        start.record()
        for _ in range(50):
            graphs._graphs[size].replay()
        end.record()
        torch.cuda.synchronize()
        host.sort()
        out[batch] = {"graph_replay_ms": start.elapsed_time(end) / 50, "engine_step_ms_median": 1000 * host[16],
                      "engine_step_ms_min": 1000 * host[0]}
        print(f"decode batch {batch}: {out[batch]}", flush=True)
    return out


def main(out_path: str) -> None:
    results = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
               "greedy_equal_to_cpu_first32": greedy_equality(), "decode_step": step_times()}
    with open(out_path, "w") as fh:
        json.dump(results, fh, indent=2)


if __name__ == "__main__":
    main(sys.argv[1])
