"""Time the Triton ``gemv`` against cuBLAS (``torch.nn.functional.linear``) on the decode-time projections of
Llama-3.2-1B in bfloat16, at M = 1, 2 and 4 rows, on the GPU.

Each measurement captures 20 back-to-back calls in one CUDA graph and times its replays with CUDA events, as the
engine's decode step runs them. The calls rotate through enough copies of the weight (>= 4, >= 2x the L2 in total)
that no call finds its weight in L2. With ``--splits`` the narrow matrices are also timed at every split of K, to
check :func:`choose_split_k` against.

Usage: python benchmarks/gemv_sweep.py [--splits]
"""

from __future__ import annotations

import math
import sys

import torch
import torch.nn.functional as F
from rtx_kernels import gemv as gemv_module
from rtx_kernels.gemv import choose_split_k, gemv

SHAPES = {"qkv": (3072, 2048), "o_proj": (2048, 2048), "gate_up": (16384, 2048), "down_proj": (2048, 8192),
          "lm_head": (128256, 2048)}
ROWS = (1, 2, 4)
CALLS_PER_GRAPH = 20
REPLAYS = 20
COPY_BW = 4.24e12  # bytes/s, device-to-device copy measured on the H200 (shared/ENVIRONMENT.md)
DTYPE = torch.bfloat16


def time_graph(fn, weights) -> float:
    """Microseconds per call of ``fn(weight)`` over CALLS_PER_GRAPH calls captured in one graph."""
    for w in weights:  # warm-up, and autotuning, outside the capture
        fn(w)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(CALLS_PER_GRAPH):
            fn(weights[i % len(weights)])
    for _ in range(3):
        graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(REPLAYS):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / (REPLAYS * CALLS_PER_GRAPH)


def describe(config) -> str:
    kw = config.kwargs
    return f"BN={kw['BLOCK_N']} BK={kw['BLOCK_K']} stages={kw['STAGES']} warps={config.num_warps}"


def main(sweep_splits: bool) -> None:
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    print(f"{torch.cuda.get_device_name(0)}: {sms} SMs, L2 {l2 / 2**20:.0f} MiB; {DTYPE}, "
          f"{CALLS_PER_GRAPH} calls per graph")
    table = []
    for name, (n, k) in SHAPES.items():
        weight_bytes = n * k * DTYPE.itemsize
        num_sets = max(4, math.ceil(2 * l2 / weight_bytes))
        weights = [torch.randn(n, k, device="cuda", dtype=DTYPE) / math.sqrt(k) for _ in range(num_sets)]
        auto_split = choose_split_k(n, k, sms)
        splits = sorted({auto_split, 1, 2, 4, 8}) if sweep_splits and n <= 4096 else [auto_split]
        for m in ROWS:
            x = torch.randn(m, k, device="cuda", dtype=DTYPE)
            out = torch.empty(m, n, device="cuda", dtype=DTYPE)
            total_bytes = weight_bytes + (m * k + m * n) * DTYPE.itemsize
            ref = F.linear(x, weights[0])
            err = ((gemv(x, weights[0]).float() - ref.float()).norm() / ref.float().norm()).item()
            assert err < 1e-2, f"{name} M={m}: relative error {err:.2e} against F.linear"

            cublas_us = time_graph(lambda w, x=x: F.linear(x, w), weights)
            timed = {}
            for split in splits:
                us = time_graph(lambda w, x=x, out=out, s=split: gemv(x, w, out=out, split_k=s), weights)
                timed[split] = (us, describe(gemv_module._gemv_kernel.best_config))
            us, config = timed[auto_split]
            print(f"\n{name} N={n} K={k} M={m} ({num_sets} weight copies, floor "
                  f"{total_bytes / COPY_BW * 1e6:.2f} us at {COPY_BW / 1e12:.2f} TB/s)")
            print(f"  cuBLAS      {cublas_us:7.2f} us  {total_bytes / cublas_us / 1e6:5.2f} TB/s")
            for split, (s_us, s_config) in timed.items():
                mark = " <- choose_split_k" if split == auto_split and len(timed) > 1 else ""
                print(f"  gemv split={split} {s_us:7.2f} us  {total_bytes / s_us / 1e6:5.2f} TB/s  "
                      f"x{cublas_us / s_us:4.2f} vs cuBLAS  [{s_config}]{mark}")
            best_split = min(timed, key=lambda s: timed[s][0])
            table.append((name, m, cublas_us, us, total_bytes, auto_split, best_split, timed[best_split][0], config))

        del weights
        torch.cuda.empty_cache()

    print(f"\n{'matrix':<10}{'M':>2} {'cuBLAS us':>10} {'gemv us':>8} {'cuBLAS TB/s':>12} {'gemv TB/s':>10} "
          f"{'speedup':>8} {'split':>6} {'best split (us)':>16}  config")
    for name, m, cublas_us, us, nbytes, split, best, best_us, config in table:
        print(f"{name:<10}{m:>2} {cublas_us:>10.2f} {us:>8.2f} {nbytes / cublas_us / 1e6:>12.2f} "
              f"{nbytes / us / 1e6:>10.2f} {cublas_us / us:>7.2f}x {split:>6} {f'{best} ({best_us:.2f})':>16}  {config}")


if __name__ == "__main__":
    main("--splits" in sys.argv[1:])
