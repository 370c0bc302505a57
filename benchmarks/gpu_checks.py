"""Correctness and step-time checks of the torch backend on a CUDA GPU (benchmarks/gpu.py steps greedy, decode).

1. Greedy tokens of the default model's shape with random weights (float32) on the GPU, with CUDA graphs and
   eagerly, equal the CPU path's for the first 32 tokens of each prompt: six prompts decoding together, and one
   alone (one-row steps, whose projections run through the GEMV kernel). Given a model (the default model's GGUF),
   the same on its real weights.
2. Where a decode step's time goes on ``dummy:llama-1b`` (bfloat16): one graph replay timed with CUDA events, against
   the whole engine step timed on the host, at batch 1 and 256; at batch 1 for each RTX_TORCH_GEMV choice.
3. What continuous batching's steps cost on W2 (``dummy:llama-1b``, 32 running at most), steps run synchronously
   and timed one by one: decode-only steps (decode CUDA graphs) against steps that carry a newcomer's prefill
   (piecewise CUDA graphs around eager attention).
4. Where a batch-1 decode graph replay of ``dummy:llama-1b`` spends its time, kernel by kernel, under the torch
   profiler: W3's step, against the weight-read floor of 0.583 ms.
Usage: python benchmarks/gpu_checks.py OUT.json [mixed|decode|kernels|greedy [MODEL]]   (mixed: only the third;
       decode: the first two, without the RTX_TORCH_GEMV comparison; kernels: the fourth; greedy: the first, on
       MODEL's weights when given)
"""

from __future__ import annotations

import json
import os
import sys
import time

import torch

from rtxcore.bench.engine import Engine, build_engine, drain, generate
from rtxcore.contracts.scheduler import SchedulerConfig
from rtxcore.sampling_params import SamplingParams


def engine(model: str, device: str, dtype: str, eager: bool = False, **sched) -> Engine:
    return build_engine(model=model, device=device, dtype=dtype, enforce_eager=eager, max_model_len=4096,
                        scheduling=SchedulerConfig(**sched))


def greedy_equality(model: str = "dummy:smollm2-135m") -> dict:
    params = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    prompts = [[100 + (i * 37 + j * 11) % 40000 for j in range(20 + 7 * i)] for i in range(6)]
    runs = {}
    for label, device, eager in (("cpu", "cpu", True), ("cuda graphs", "cuda", False), ("cuda eager", "cuda", True)):
        e = engine(model, device, "float32", eager)
        runs[label] = [r.token_ids for r in generate(e, prompts, params)]
        runs[label] += [r.token_ids for r in generate(e, prompts[:1], params)]
    out = {}
    for label, toks in runs.items():
        if label == "cpu":
            continue
        out[label] = [a == b for a, b in zip(runs["cpu"], toks)]
        first_diff = [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
                      for a, b in zip(runs["cpu"], toks)]
        print(f"greedy {label} == cpu: {out[label]} (first differing token: {first_diff})", flush=True)
    return out


def decode_graph(e: Engine, batch: int):
    """The engine's captured decode graph that runs ``batch`` rows (the smallest size at least that)."""
    graphs = e.core.backend._graphs
    return graphs._graphs[next(s for s in graphs.sizes if s >= batch)]


def replay_ms(graph, replays: int = 50) -> float:
    """One replay of ``graph``, device time by CUDA events over ``replays`` after 5 untimed."""
    for _ in range(5):
        graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / replays


def replay_kernels(graph, replays: int = 50) -> list[tuple[str, float, int]]:
    """``(kernel name, µs per replay, launches per replay)`` of ``graph`` under the torch profiler, largest first."""
    for _ in range(5):
        graph.replay()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            graph.replay()
        torch.cuda.synchronize()
    return sorted(((ev.key, ev.device_time_total / replays, ev.count // replays) for ev in prof.key_averages()
                   if ev.device_time_total > 0), key=lambda r: -r[1])


def step_times(batches=(1, 256), label: str = "") -> dict:
    e = engine("dummy:llama-1b", "cuda", "bfloat16", max_num_batched_tokens=8192, max_num_seqs=256)
    out = {}
    for batch in batches:
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
        host.sort()
        out[batch] = {"graph_replay_ms": replay_ms(decode_graph(e, batch)), "engine_step_ms_median": 1000 * host[16],
                      "engine_step_ms_min": 1000 * host[0]}
        print(f"decode batch {batch}{label}: {out[batch]}", flush=True)
    return out


def decode_kernels(batch: int = 1, replays: int = 50) -> dict:
    """Device time per kernel (by name) of one decode graph replay at ``batch``, largest first."""
    e = engine("dummy:llama-1b", "cuda", "bfloat16", max_num_batched_tokens=8192, max_num_seqs=256)
    params = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
    for i in range(batch):
        e.add_request([1000 + (i * 7 + j) % 5000 for j in range(128)], params)
    for _ in range(12):
        e.step()
    while e.has_unfinished_requests():
        e.step()
    rows = replay_kernels(decode_graph(e, batch), replays)
    total = sum(us for _, us, _ in rows)
    print(f"decode graph replay at batch {batch}: {total:.1f} us of kernels a step", flush=True)
    for name, us, count in rows[:25]:
        print(f"  {us:8.1f} us  x{count:<3} {name[:110]}", flush=True)
    return {"batch": batch, "kernel_us_per_step": total,
            "kernels": [{"name": n, "us_per_step": us, "launches_per_step": c} for n, us, c in rows]}


def gemv_choices() -> dict:
    out = {}
    for choice in ("0", "1"):
        os.environ["RTX_TORCH_GEMV"] = choice
        out[choice] = step_times((1,), f", RTX_TORCH_GEMV={choice}")[1]
    del os.environ["RTX_TORCH_GEMV"]
    return out


def mixed_steps(max_num_seqs: int = 32) -> dict:
    from rtxcore.bench.workloads import make_requests

    e = build_engine(model="dummy:llama-1b", device="cuda", dtype="bfloat16", max_model_len=4096,
                     async_scheduling=False,
                     scheduling=SchedulerConfig(max_num_batched_tokens=8192, max_num_seqs=max_num_seqs))
    schedule, last = e.core.scheduler.schedule, {}

    def recording_schedule():
        last["out"] = schedule()
        return last["out"]

    e.core.scheduler.schedule = recording_schedule
    # The first pass compiles every kernel specialization the workload reaches; only the second is counted.
    for _ in range(2):
        requests = [(r.prompt_token_ids, SamplingParams(max_tokens=r.output_len, temperature=0.0, ignore_eos=True))
                    for r in make_requests("W2", e.core.model_config.vocab_size, seed=0)]
        kinds = {"decode": [0, 0.0], "mixed": [0, 0.0]}
        prefill_tokens = 0

        def timed_step(step, kinds=kinds):
            nonlocal prefill_tokens
            torch.cuda.synchronize()
            t = time.perf_counter()
            outputs = step()
            torch.cuda.synchronize()
            dt = time.perf_counter() - t
            sched = last["out"]
            prefill = sum(n for n in sched.num_scheduled_tokens if n > 1)
            kind = "mixed" if prefill else "decode"
            kinds[kind][0] += 1
            kinds[kind][1] += dt
            prefill_tokens += prefill
            return outputs

        drain(e, requests, timed_step)
    out = {k: {"steps": n, "total_s": round(t, 3), "ms_per_step": round(1000 * t / max(n, 1), 3)}
           for k, (n, t) in kinds.items()}
    out["prefill_tokens"] = prefill_tokens
    print(f"W2 steps at {max_num_seqs} running, synchronous: {out}", flush=True)
    return out


def main(out_path: str, only: str | None = None, model: str | None = None) -> None:
    if only == "greedy":
        with open(out_path, "w") as fh:
            json.dump({"model": model or "dummy:smollm2-135m",
                       "greedy_equal_to_cpu_first32": greedy_equality(*([model] if model else []))}, fh, indent=2)
        return
    if only == "decode":
        # Greedy equality and decode step times only (benchmarks/gpu.py decode).
        results = {"rtx_pdl": os.environ.get("RTX_PDL", "1"), "greedy_equal_to_cpu_first32": greedy_equality(),
                   "decode_step": step_times(label=f", RTX_PDL={os.environ.get('RTX_PDL', '1')}")}
        with open(out_path, "w") as fh:
            json.dump(results, fh, indent=2)
        return
    if only == "kernels":
        with open(out_path, "w") as fh:
            json.dump({"decode_kernels": decode_kernels()}, fh, indent=2)
        return
    if only == "mixed":
        results = {"w2_steps": mixed_steps()}
        with open(out_path, "w") as fh:
            json.dump(results, fh, indent=2)
        return
    results = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
               "greedy_equal_to_cpu_first32": greedy_equality(), "decode_step": step_times(),
               "batch1_by_gemv_choice": gemv_choices(), "w2_steps": mixed_steps()}
    with open(out_path, "w") as fh:
        json.dump(results, fh, indent=2)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else None, sys.argv[3] if len(sys.argv) > 3 else None)
