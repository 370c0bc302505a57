"""Per-kernel GPU time of one decode step of ``dummy:llama-1b`` (bfloat16), eager, under torch.profiler.
``--model`` and ``--quantization`` profile another shape or quantized weights (e.g. ``dummy:llama-8b`` in int4, W3's
decode step at batch 1).

Kernel durations are the same inside a CUDA graph; what the graph removes is the launch gaps between them.
``mixed`` profiles instead steps of 31 decoding requests that each also carry a newcomer's 640-token prefill, the
steps continuous batching runs whenever a request joins (run once unprofiled first, so nothing compiles inside).
Usage: python benchmarks/gpu_profile.py [BATCH ...] [mixed] [--model dummy:llama-1b] [--quantization int4]
"""

from __future__ import annotations

import argparse

import torch
from torch.profiler import ProfilerActivity, profile

from rtxcore.contracts.scheduler import SchedulerConfig
from rtxcore.engine.config import EngineConfig
from rtxcore.engine.llm_engine import LLMEngine
from rtxcore.sampling_params import SamplingParams


def mixed(e: LLMEngine) -> None:
    params = SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True)
    for i in range(31):
        e.add_request([1000 + (i * 7 + j) % 5000 for j in range(800)], params)
    for _ in range(6):
        e.step()

    def join_and_step(seed: int) -> None:
        e.add_request([2000 + (seed * 13 + j) % 5000 for j in range(640)], SamplingParams(max_tokens=1))
        e.step()
        e.step()

    join_and_step(0)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for seed in range(1, 6):
            join_and_step(seed)
        torch.cuda.synchronize()
    for req_id in list(e.requests):
        e.abort(req_id)
    print("\n=== 5 x (mixed step: 31 decodes + 640 prefill tokens, then a 31-row decode step), eager ===")
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=24, max_name_column_width=70))


def main(batches: list[int], with_mixed: bool, model: str, quantization: str | None) -> None:
    e = LLMEngine(EngineConfig(model=model, quantization=quantization, device="cuda", dtype="bfloat16",
                               enforce_eager=True, max_model_len=4096,
                               scheduling=SchedulerConfig(max_num_batched_tokens=8192, max_num_seqs=256)))
    for batch in batches:
        params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
        for i in range(batch):
            e.add_request([1000 + (i * 7 + j) % 5000 for j in range(256)], params)
        for _ in range(8):
            e.step()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(10):
                e.step()
            torch.cuda.synchronize()
        while e.has_unfinished_requests():
            e.step()
        print(f"\n=== {model} {quantization or 'bf16'}, decode batch {batch}: 10 steps ===")
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=26, max_name_column_width=70))
    if with_mixed:
        mixed(e)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("what", nargs="*", help="decode batch sizes, and/or 'mixed'")
    parser.add_argument("--model", default="dummy:llama-1b")
    parser.add_argument("--quantization", default=None)
    args = parser.parse_intermixed_args()
    if any(a != "mixed" and not a.isdigit() for a in args.what):
        parser.error(f"expected batch sizes and/or 'mixed', got {args.what}")
    batches = [int(a) for a in args.what if a != "mixed"]
    main(batches if batches or "mixed" in args.what else [1, 256], "mixed" in args.what, args.model,
         args.quantization)
