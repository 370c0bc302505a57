"""What one row of x can get out of memory on the GPU: the GEMVs beside a kernel that only reads, at one shape.

For a projection of Llama-3.1-8B it times, as ``quant_sweep.py`` does (CUDA-graph replays over weight copies that
do not fit in L2): int4's two GEMVs, the bf16 GEMV and cuBLAS, and a Triton kernel that reads the int4 weight's
bytes and nothing else, laid out as the GEMV reads them (one program per block of rows, each loading its rows once).
That last figure is the ceiling a GEMV with that grid can reach at that size, launch ramp and tail included.

With ``--profile`` it then runs each kernel once between ``cudaProfilerStart`` and ``cudaProfilerStop``, for
``ncu --profile-from-start off`` (gpu_bench.sh's ``int4ncu`` step): warm-up and autotuning stay outside.

Usage: python benchmarks/gemv_profile.py [--shapes gate_up,qkv] [--rows 1] [--profile]
"""

from __future__ import annotations

import argparse
import math

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from quant_sweep import SHAPES, best_config, random_int4, time_graph


@triton.jit
def _read_rows_kernel(w_ptr, out_ptr, NUM_WORDS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_W: tl.constexpr):
    # Each thread reads 16-byte vectors of its rows, as the int4 GEMV does, and folds them so nothing is dropped.
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = tl.arange(0, BLOCK_W)
    acc = tl.zeros([BLOCK_N, BLOCK_W], tl.int32)
    for w0 in range(0, NUM_WORDS, BLOCK_W):
        acc |= tl.load(w_ptr + rows.to(tl.int64)[:, None] * NUM_WORDS + (w0 + cols)[None, :],
                       mask=(w0 + cols < NUM_WORDS)[None, :], other=0)
    tl.store(out_ptr + tl.program_id(0), tl.sum(tl.sum(acc, 1), 0))


def read_rows(packed: torch.Tensor, out: torch.Tensor, block_n: int = 8) -> None:
    n, num_words = packed.shape
    _read_rows_kernel[(triton.cdiv(n, block_n),)](packed, out, NUM_WORDS=num_words, BLOCK_N=block_n, BLOCK_W=512,
                                                  num_warps=4)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default="gate_up,qkv,o_proj,down_proj")
    parser.add_argument("--rows", type=int, default=1)
    parser.add_argument("--group-size", type=int, default=128)
    parser.add_argument("--profile", action="store_true", help="run each kernel once more for ncu")
    args = parser.parse_args()
    from rtx_kernels import quant_fma_gemv, quant_mma_gemv
    from rtx_kernels.gemv import gemv
    from rtx_kernels.quant_matmul import int4_linear

    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    group = args.group_size
    print(f"{'matrix':<10}{'kernel':<12}{'us':>8}{'GB/s':>8}  (bytes: int4 words+scales+zeros; read-int4 the words; "
          "bf16 the weight)")
    for name in args.shapes.split(","):
        n, k = SHAPES[name]
        int4_bytes = n * k // 2 + n * (k // group) * 5
        int4 = [random_int4(n, k, group) for _ in range(max(4, math.ceil(2 * l2 / int4_bytes)))]
        bf16 = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / math.sqrt(k)
                for _ in range(max(4, math.ceil(l2 / (n * k))))]
        x = torch.randn(args.rows, k, device="cuda", dtype=torch.bfloat16)
        sink = torch.empty(n, dtype=torch.int32, device="cuda")
        calls = {
            "int4-fma": (lambda i: int4_linear(x, *int4[i % len(int4)], group, kernel="gemv"), int4_bytes),
            "int4-mma": (lambda i: int4_linear(x, *int4[i % len(int4)], group, kernel="mma"), int4_bytes),
            "read-int4": (lambda i: read_rows(int4[i % len(int4)][0], sink), n * k // 2),
            "bf16-gemv": (lambda i: gemv(x, bf16[i % len(bf16)]), n * k * 2),
            "cublas": (lambda i: F.linear(x, bf16[i % len(bf16)]), n * k * 2),
        }
        autotuned = {"int4-fma": quant_fma_gemv._gemv_kernel, "int4-mma": quant_mma_gemv._mma_gemv_kernel}
        for kernel, (call, nbytes) in calls.items():
            us = time_graph(call, max(len(int4), len(bf16)))
            config = best_config(autotuned[kernel]) if kernel in autotuned else ""
            print(f"{name:<10}{kernel:<12}{us:>8.2f}{nbytes / us / 1e3:>8.0f}  {config}", flush=True)
        if args.profile:
            torch.cuda.synchronize()
            torch.cuda.cudart().cudaProfilerStart()
            for call, _ in calls.values():
                call(0)
            torch.cuda.synchronize()
            torch.cuda.cudart().cudaProfilerStop()
        int4 = bf16 = None  # the shape's weights, freed before the next shape's are drawn
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
