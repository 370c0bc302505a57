"""Per-kernel GPU time of one decode step of ``dummy:llama-1b`` (bfloat16), eager, under torch.profiler.

Kernel durations are the same inside a CUDA graph; what the graph removes is the launch gaps between them.
Usage: python benchmarks/gpu_profile.py [BATCH ...]
"""

from __future__ import annotations

import sys

import torch
from torch.profiler import ProfilerActivity, profile

from rtxcore.contracts.scheduler import SchedulerConfig
from rtxcore.engine.config import EngineConfig
from rtxcore.engine.llm_engine import LLMEngine
from rtxcore.sampling_params import SamplingParams


def main(batches: list[int]) -> None:
    e = LLMEngine(EngineConfig(model="dummy:llama-1b", device="cuda", dtype="bfloat16", enforce_eager=True,
                               max_model_len=4096,
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
        print(f"\n=== decode batch {batch}: 10 steps ===")
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=18, max_name_column_width=70))


if __name__ == "__main__":
    main([int(b) for b in sys.argv[1:]] or [1, 256])
