"""``y = (x_q @ W_q.T) * x_scale * w_scale (+ bias)`` on fp8 tensor cores, in Triton, for decode-sized batches.

``x_q`` is e4m3 [M, K] with one float32 scale a row (the activations, rounded per token), ``W_q`` e4m3 [N, K] with
one float32 scale an output channel (the fp8 quantizer's stored form); the product accumulates in float32 and is
rounded once to bfloat16, as ``torch._scaled_mm`` with row-wise scales returns it.

Why not only ``_scaled_mm``: at 32-64 rows cuBLAS picks 128x128 tiles, which leaves most of an H100's 132 SMs idle
on llama-8b's 4096-wide outputs (o_proj, down) and reads the weight at 1.2-1.7 TB/s. Smaller tiles with deeper K
steps keep more SMs streaming: over one layer's four projections, with the launch shapes of :func:`launch_shape`,
94.7 us at 32 rows and 96.4 at 64 against cuBLAS's 108.9 and 112.9 with fast accumulation (124.1 and 118.4
without; H100, CUDA graphs, ``benchmarks/fp8_gemm_sweep.py``, docs/benchmarks.md). From 128 rows cuBLAS is
faster (109.7 against 143.5 us): the caller keeps it there (``applies``, :data:`MAX_ROWS`).

The accumulation is as precise as cuBLAS's default: Hopper's fp8 MMA adds its products into an accumulator narrower
than float32, and Triton's default on sm_90 keeps the whole K loop there. This kernel's first version did, and was
faster still (a layer 83.5 us at 32 rows, 124.9 at 256; W8B +2.4% in the engine), but an output of a 14,336-deep
product was then off by about 1.5% of its magnitude, where cuBLAS stays within a bfloat16 rounding; partial sums are
therefore promoted to the float32 accumulator every :data:`_PROMOTE_EVERY` products (the products then equal
cuBLAS's to its rounding, tests/kernels/test_kernels_fp8_matmul.py). In the engine it made W2 at 64 running 2.3%
faster on an H100 (docs/benchmarks.md); ``RTX_FP8_TRITON_GEMM=0`` runs cuBLAS's products instead.

The launch shape per output width comes from a sweep (``launch_shape``), not from autotuning at run time, so that a
call is the same kernel in a CUDA graph capture as in eager mode and nothing is timed in a serving process.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from rtxcore import envs

# Rows up to which the Triton kernel runs (see the module docstring).
MAX_ROWS = 64
# Grouped tile order: this many row tiles walk the same column tiles together, so a weight tile read by one is
# still in L2 for the others.
_GROUP_M = 8
# Products summed in the MMA's own accumulator before they are added to the float32 one (see the module docstring);
# DeepSeek-V3's report chose the same interval for its fp8 GEMMs.
_PROMOTE_EVERY = 128


@triton.jit
def _fp8_matmul_kernel(x_ptr, w_ptr, out_ptr, x_scale_ptr, w_scale_ptr, bias_ptr, M, N, K,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                       EVEN_K: tl.constexpr, HAS_BIAS: tl.constexpr, PROMOTE_EVERY: tl.constexpr):
    pid = tl.program_id(0)
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    group_first_m = (pid // (GROUP_M * num_n)) * GROUP_M
    group_size_m = min(num_m - group_first_m, GROUP_M)
    pid_m = group_first_m + (pid % group_size_m)
    pid_n = (pid % (GROUP_M * num_n)) // group_size_m
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    x_tile = x_ptr + rows[:, None].to(tl.int64) * K + ks[None, :]
    w_tile = w_ptr + cols[:, None].to(tl.int64) * K + ks[None, :]
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        if EVEN_K:
            x = tl.load(x_tile, mask=rows[:, None] < M, other=0.0)
            w = tl.load(w_tile, mask=cols[:, None] < N, other=0.0)
        else:
            inside = k0 + ks[None, :] < K
            x = tl.load(x_tile, mask=(rows[:, None] < M) & inside, other=0.0)
            w = tl.load(w_tile, mask=(cols[:, None] < N) & inside, other=0.0)
        acc = tl.dot(x, tl.trans(w), acc, max_num_imprecise_acc=PROMOTE_EVERY)
        x_tile += BLOCK_K
        w_tile += BLOCK_K
    x_scale = tl.load(x_scale_ptr + rows, mask=rows < M, other=0.0)
    w_scale = tl.load(w_scale_ptr + cols, mask=cols < N, other=0.0)
    out = acc * x_scale[:, None] * w_scale[None, :]
    if HAS_BIAS:
        out += tl.load(bias_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + rows[:, None].to(tl.int64) * N + cols[None, :], out.to(tl.bfloat16),
             mask=(rows[:, None] < M) & (cols[None, :] < N))


@dataclass(frozen=True, slots=True)
class LaunchShape:
    block_m: int
    block_n: int
    block_k: int
    stages: int
    warps: int


def launch_shape(n: int, k: int) -> LaunchShape:
    """The fastest at 16, 32 and 64 rows in a sweep of this kernel (partial sums promoted every 128 products) over
    BLOCK_M 64/128, BLOCK_N 64/128/256, BLOCK_K 128/256, 4 or 6 stages and 4 or 8 warps
    (``benchmarks/fp8_gemm_sweep.py --rows 16,32,64 --sweep``, H100, 2026-12-07) on llama-8b's projections, by output
    width ``n`` and depth ``k``; any row count takes it (the kernel runs up to :data:`MAX_ROWS`). The same at the
    three row counts: gate|up 45.0-46.8 us, down 30.1-30.9, qkv 9.4-9.6, o 9.3 (the previous shapes, BLOCK_K 256 and 4
    warps everywhere: 45.9-48.0, 34.8-35.8, 11.9-12.2, 11.8-12.1)."""
    if n >= 16384:  # gate|up
        return LaunchShape(64, 128, 256, 4, 8)
    return LaunchShape(64, 64, 128, 6 if k > 8192 else 4, 4)  # down; qkv and o


@functools.cache
def _applies_on(device_index: int) -> bool:
    # The launch shapes take up to 192 KiB of shared memory and were chosen on Hopper: compute capability 9 only.
    # RTX_FP8_TRITON_GEMM is read here once per process (a per-call path).
    return envs.RTX_FP8_TRITON_GEMM.get() and torch.cuda.get_device_capability(device_index)[0] == 9


def applies(x: torch.Tensor) -> bool:
    """Whether :func:`fp8_matmul` should run the product of these rounded rows (else ``torch._scaled_mm``): up to
    :data:`MAX_ROWS` on a Hopper GPU, unless ``RTX_FP8_TRITON_GEMM`` turns it off."""
    return x.is_cuda and x.dim() == 2 and x.shape[0] <= MAX_ROWS and _applies_on(x.device.index or 0)


def fp8_matmul(x: torch.Tensor, x_scale: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
               bias: torch.Tensor | None = None, shape: LaunchShape | None = None) -> torch.Tensor:
    """bfloat16 [M, N] for ``x`` e4m3 [M, K] (contiguous rows), ``x_scale`` float32 [M, 1] or [M], ``weight`` e4m3
    [N, K] (contiguous), ``weight_scale`` float32 [N] and an optional ``bias`` [N]; ``shape`` overrides
    :func:`launch_shape` (sweeps)."""
    m, k = x.shape
    n = weight.shape[0]
    if weight.shape[1] != k or x.dtype != torch.float8_e4m3fn or weight.dtype != torch.float8_e4m3fn:
        raise ValueError(f"x {tuple(x.shape)} {x.dtype} and weight {tuple(weight.shape)} {weight.dtype} must be "
                         "e4m3 [M, K] and [N, K]")
    x, weight = x.contiguous(), weight.contiguous()
    out = torch.empty(m, n, dtype=torch.bfloat16, device=x.device)
    if m and n:
        ls = shape or launch_shape(n, k)
        grid = (triton.cdiv(m, ls.block_m) * triton.cdiv(n, ls.block_n),)
        _fp8_matmul_kernel[grid](
            x, weight, out, x_scale.reshape(-1).contiguous(), weight_scale.contiguous(),
            bias.contiguous() if bias is not None else out, m, n, k,
            BLOCK_M=ls.block_m, BLOCK_N=ls.block_n, BLOCK_K=ls.block_k, GROUP_M=_GROUP_M, EVEN_K=k % ls.block_k == 0,
            HAS_BIAS=bias is not None, PROMOTE_EVERY=min(_PROMOTE_EVERY, ls.block_k), num_stages=ls.stages,
            num_warps=ls.warps)
    return out
