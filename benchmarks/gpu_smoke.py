"""First look at the torch backend on a CUDA GPU, runnable from a source tree without installing the package.

Checks greedy tokens on the GPU against the CPU path (default model's shape, random weights, float32 both), then
times W3 (single stream) and W1 (256 x 128/256) on ``dummy:llama-1b`` in bfloat16 with the eager torch path.
Usage: PYTHONPATH=. python benchmarks/gpu_smoke.py OUT.json
"""

from __future__ import annotations

import json
import sys
import time

import torch

import rtx_plugins.backends.torch_backend as torch_backend
import rtx_plugins.eviction.lru as lru
import rtx_plugins.samplers.default as default_sampler
import rtx_plugins.schedulers.fcfs as fcfs
from rtxcore.bench.offline import run_engine, warm_up
from rtxcore.bench.workloads import make_requests
from rtxcore.contracts.scheduler import SchedulerConfig
from rtxcore.engine.config import EngineConfig
from rtxcore.engine.llm_engine import LLMEngine
from rtxcore.registry import load_plugins
from rtxcore.sampling_params import SamplingParams

REGISTRY = load_plugins(load_entrypoints=False, extra=[
    ("torch", torch_backend), ("lru", lru), ("default-sampler", default_sampler), ("fcfs", fcfs)])


def engine(model: str, device: str, dtype: str, **sched) -> LLMEngine:
    return LLMEngine(EngineConfig(model=model, device=device, dtype=dtype,
                                  scheduling=SchedulerConfig(**sched)), registry=REGISTRY)


def main(out_path: str) -> None:
    results: dict = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    params = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    prompts = [[100 + (i * 37 + j * 11) % 40000 for j in range(20 + 7 * i)] for i in range(4)]
    cpu = [r.token_ids for r in engine("dummy:smollm2-135m", "cpu", "float32").generate(prompts, params)]
    gpu = [r.token_ids for r in engine("dummy:smollm2-135m", "cuda", "float32").generate(prompts, params)]
    results["greedy_gpu_equals_cpu_first32"] = [a == b for a, b in zip(cpu, gpu)]
    print("greedy GPU == CPU:", results["greedy_gpu_equals_cpu_first32"], flush=True)

    e = engine("dummy:llama-1b", "cuda", "bfloat16", max_num_batched_tokens=8192, max_num_seqs=256)
    warm_up(e)
    w3 = run_engine(e, make_requests("W3", e.model_config.vocab_size))
    torch.cuda.synchronize()
    results["W3_llama1b_ms_per_token"] = w3.ms_per_token_per_request
    print(f"W3 llama-1b: {w3.ms_per_token_per_request:.2f} ms/token", flush=True)
    start = time.perf_counter()
    w1 = run_engine(e, make_requests("W1", e.model_config.vocab_size))
    results["W1_llama1b_tok_s"] = w1.tokens_per_s
    results["W1_elapsed_s"] = time.perf_counter() - start
    print(f"W1 llama-1b: {w1.tokens_per_s:.0f} tok/s", flush=True)
    with open(out_path, "w") as fh:
        json.dump(results, fh, indent=2)


if __name__ == "__main__":
    main(sys.argv[1])
