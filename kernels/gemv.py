"""``y = x @ weight.T (+ bias)`` for a handful of rows of ``x``: the decode-time linear layer, in Triton.

With M <= 8 rows the product is a matrix-vector product bound by reading ``weight`` once, so the kernel is
written for bandwidth rather than FLOPs. Each program owns ``BLOCK_N`` rows of ``weight`` ([N, K], nn.Linear's
row-major layout) and streams its slice along K in wide coalesced loads, ``tl.range(num_stages=...)`` turning the
loop into a cp.async pipeline; every weight tile is multiplied by all M rows of ``x`` before the next is loaded, so
W is read from memory once whatever M is. Products accumulate in fp32, elementwise, and are summed across K only
once at the end. The output takes ``x``'s dtype.

Narrow, tall-K matrices (down_proj: N=2048, K=8192) have too few row tiles to keep every SM streaming; there the
grid also splits K (:func:`choose_split_k`, a function of N and K only), each split writes an fp32 partial and a
second kernel adds the splits up in a fixed order. No atomics, so a given launch is bit-for-bit reproducible.

The grid depends only on shapes, there is no host sync, and the split buffer is fully overwritten, so calls can be
captured in a CUDA graph. Tile shapes are autotuned per (N, K, M bucket, split, dtypes) on the first call for a
key, which must therefore come before capture (the engine's warm-up run does that). Different processes may tune
to different tiles and so round differently in the last bit; within a process results never change.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

from rtx_kernels.pdl import gemv_launch_mode, launch_options, wait_for_previous

# Rows of x per launch: one fp32 accumulator tile per row lives in registers.
_MAX_M = 8
_MAX_SPLIT_K = 8
# A split shorter than this spends too little time streaming to pay for its share of the reduce launch.
_MIN_K_PER_SPLIT = 2048
_REDUCE_BLOCK = 512


def _config(block_n: int, num_warps: int, stages: int, chunks: int = 1) -> triton.Config:
    # BLOCK_K = 8 columns (16 bytes of bf16) x 32 lanes x num_warps x chunks: the warps then lie along K, so a
    # thread holds the same columns in every row of its tile and the 1-D load of x lands in exactly the layout
    # x[None, :] needs (no conversion through shared memory), reused from registers across the tile's rows.
    return triton.Config({"BLOCK_N": block_n, "BLOCK_K": 256 * num_warps * chunks, "STAGES": stages},
                         num_warps=num_warps)


# Few rows per program, so that even N=2048 makes ~1000 programs; stages > 1 turn the K loop into a cp.async
# pipeline, which puts more bytes in flight per SM when a program's turn is short on them.
_GPU_CONFIGS = [
    _config(1, 4, 3),
    _config(2, 4, 1),
    _config(2, 4, 3),
    _config(4, 4, 1),
    _config(4, 4, 3),
    _config(8, 4, 2),
    _config(2, 8, 2),
    _config(4, 8, 2),
    _config(2, 4, 2, chunks=2),
    _config(1, 2, 4),
]
# The interpreter runs each config for real and is slow: one small config, whose blocks the tests' odd shapes
# straddle, so every mask is exercised.
_INTERPRETER_CONFIGS = [triton.Config({"BLOCK_N": 32, "BLOCK_K": 32, "STAGES": 1}, num_warps=1)]
_CONFIGS = _INTERPRETER_CONFIGS if os.environ.get("TRITON_INTERPRET") == "1" else _GPU_CONFIGS
# fp32 accumulator registers per thread (BLOCK_M tiles of BLOCK_N x BLOCK_K over the threads) allowed: past it a
# config needs > 128 registers in all (ptxas, sm_90) and fits too few threads per SM to keep loads in flight.
_MAX_ACC_REGS = 64


def _prune_configs(configs, named_args, **kwargs):
    def acc_regs(c: triton.Config) -> int:
        return kwargs["BLOCK_M"] * c.kwargs["BLOCK_N"] * c.kwargs["BLOCK_K"] // (32 * c.num_warps)

    fitting = [c for c in configs if acc_regs(c) <= _MAX_ACC_REGS]
    return fitting or [min(configs, key=acc_regs)]


@functools.cache
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def choose_split_k(n: int, k: int, num_sms: int = 132) -> int:
    """Splits of K only when N is too narrow to give every SM a 4-row tile, each split keeping >= 2048 columns.

    Measured on the H200 with a sweep, docs/benchmarks.md (2026-11-29): on every Llama-3.2-1B matrix at M <= 2 one
    split was fastest (down_proj, N=2048 K=8192: 10.6 us, against 12.6 with two and 12.0 with four), because the
    extra reduce launch costs more than the parallelism gains once N/4 >= the number of SMs.
    """
    return split_count(triton.cdiv(n, 4), num_sms, k, _MIN_K_PER_SPLIT)


def split_count(tiles: int, target: int, length: int, min_length: int) -> int:
    """Splits of K for a GEMV: doubled while ``tiles`` (programs along N) times the splits stay under ``target``
    and each split keeps at least ``min_length`` of the row's ``length``; at most 8."""
    split = 1
    while split < _MAX_SPLIT_K and tiles * split < target and length // (2 * split) >= min_length:
        split *= 2
    return split


@triton.jit
def _store_row(acc, out_ptrs, stride_om, scale, bias, M, row_mask, m: tl.constexpr):
    if M > m:
        y = tl.sum(acc, axis=1) * scale + bias
        tl.store(out_ptrs + m * stride_om, y.to(out_ptrs.dtype.element_ty), mask=row_mask)


@triton.jit
def _load_weight_tile(w_ptrs, k, k_hi, cols, EVEN_K: tl.constexpr):
    if EVEN_K:
        w = tl.load(w_ptrs + k)
    else:
        w = tl.load(w_ptrs + k, mask=(k + cols < k_hi)[None, :], other=0.0)
    return w.to(tl.float32)


@triton.jit
def _accumulate(w, x_ptrs, k, k_hi, cols, stride_xm, last, acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7,
                BLOCK_M: tl.constexpr, EVEN_K: tl.constexpr):
    """Each row of x's accumulator tile += the weight tile times that row's K slice."""
    if EVEN_K:
        k_mask, zero = None, None
    else:
        k_mask, zero = k + cols < k_hi, 0.0
    xk = x_ptrs + k
    acc0 += w * tl.load(xk, mask=k_mask, other=zero).to(tl.float32)[None, :]
    if BLOCK_M > 1:
        acc1 += w * tl.load(xk + tl.minimum(last, 1) * stride_xm, mask=k_mask, other=zero).to(tl.float32)[None, :]
    if BLOCK_M > 2:
        acc2 += w * tl.load(xk + tl.minimum(last, 2) * stride_xm, mask=k_mask, other=zero).to(tl.float32)[None, :]
        acc3 += w * tl.load(xk + tl.minimum(last, 3) * stride_xm, mask=k_mask, other=zero).to(tl.float32)[None, :]
    if BLOCK_M > 4:
        acc4 += w * tl.load(xk + tl.minimum(last, 4) * stride_xm, mask=k_mask, other=zero).to(tl.float32)[None, :]
        acc5 += w * tl.load(xk + tl.minimum(last, 5) * stride_xm, mask=k_mask, other=zero).to(tl.float32)[None, :]
        acc6 += w * tl.load(xk + tl.minimum(last, 6) * stride_xm, mask=k_mask, other=zero).to(tl.float32)[None, :]
        acc7 += w * tl.load(xk + tl.minimum(last, 7) * stride_xm, mask=k_mask, other=zero).to(tl.float32)[None, :]
    return acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7


@triton.autotune(configs=_CONFIGS, key=["N", "K", "BLOCK_M", "SPLIT_K", "PREFETCH"],
                 prune_configs_by={"early_config_prune": _prune_configs})
@triton.heuristics({"EVEN_K": lambda args: args["K"] % (args["BLOCK_K"] * args["SPLIT_K"]) == 0})
@triton.jit
def _gemv_kernel(
    x_ptr, w_ptr, scale_ptr, bias_ptr, out_ptr,
    M, N, K,
    stride_xm, stride_wn, stride_om, stride_os,
    HAS_SCALE: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, SPLIT_K: tl.constexpr,
    PREFETCH: tl.constexpr, USE_PDL: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, STAGES: tl.constexpr, EVEN_K: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = rows < N
    cols = tl.arange(0, BLOCK_K)
    k_per_split = tl.cdiv(tl.cdiv(K, SPLIT_K), BLOCK_K) * BLOCK_K
    k_lo = pid_k * k_per_split
    k_hi = tl.minimum(k_lo + k_per_split, K)

    # Past-the-end rows re-read row N-1 instead of masking, so full tiles load unpredicated; their results are
    # dropped at the store. Likewise rows of the M bucket past M re-read row M-1.
    w_ptrs = w_ptr + tl.minimum(rows, N - 1).to(tl.int64)[:, None] * stride_wn + cols[None, :]
    x_ptrs = x_ptr + cols
    last = M - 1
    # One accumulator tile per row of x (the bucket's unused ones compile away), summed across K only at the end.
    acc0 = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    acc1, acc2, acc3, acc4, acc5, acc6, acc7 = acc0, acc0, acc0, acc0, acc0, acc0, acc0
    k_start = k_lo
    if PREFETCH:
        # The first weight tile is loaded before waiting for the previous kernel (programmatic dependent launch:
        # weights are never written during a step), so its stream overlaps that kernel's tail and the launch gap.
        w = _load_weight_tile(w_ptrs, k_lo, k_hi, cols, EVEN_K)
        wait_for_previous(USE_PDL)
        acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7 = _accumulate(
            w, x_ptrs, k_lo, k_hi, cols, stride_xm, last, acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7,
            BLOCK_M, EVEN_K)
        k_start = k_lo + BLOCK_K
    else:
        wait_for_previous(USE_PDL)
    for k in tl.range(k_start, k_hi, BLOCK_K, num_stages=STAGES):
        w = _load_weight_tile(w_ptrs, k, k_hi, cols, EVEN_K)
        acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7 = _accumulate(
            w, x_ptrs, k, k_hi, cols, stride_xm, last, acc0, acc1, acc2, acc3, acc4, acc5, acc6, acc7,
            BLOCK_M, EVEN_K)

    # With SPLIT_K > 1, out is the fp32 partial buffer [SPLIT_K, M, N] and the reduce kernel scales and adds the bias.
    if HAS_BIAS and SPLIT_K == 1:
        bias = tl.load(bias_ptr + rows, mask=row_mask, other=0.0).to(tl.float32)
    else:
        bias = tl.zeros([BLOCK_N], tl.float32)
    if HAS_SCALE and SPLIT_K == 1:
        scale = tl.load(scale_ptr + rows, mask=row_mask, other=0.0)
    else:
        scale = tl.full([BLOCK_N], 1.0, tl.float32)
    out_ptrs = out_ptr + pid_k * stride_os + rows
    _store_row(acc0, out_ptrs, stride_om, scale, bias, M, row_mask, 0)
    if BLOCK_M > 1:
        _store_row(acc1, out_ptrs, stride_om, scale, bias, M, row_mask, 1)
    if BLOCK_M > 2:
        _store_row(acc2, out_ptrs, stride_om, scale, bias, M, row_mask, 2)
        _store_row(acc3, out_ptrs, stride_om, scale, bias, M, row_mask, 3)
    if BLOCK_M > 4:
        _store_row(acc4, out_ptrs, stride_om, scale, bias, M, row_mask, 4)
        _store_row(acc5, out_ptrs, stride_om, scale, bias, M, row_mask, 5)
        _store_row(acc6, out_ptrs, stride_om, scale, bias, M, row_mask, 6)
        _store_row(acc7, out_ptrs, stride_om, scale, bias, M, row_mask, 7)


@triton.jit
def _split_k_reduce_kernel(
    partial_ptr, scale_ptr, bias_ptr, out_ptr, N, stride_ps, stride_om,
    HAS_SCALE: tl.constexpr, HAS_BIAS: tl.constexpr, SPLIT_K: tl.constexpr, BLOCK: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    wait_for_previous(USE_PDL)
    m = tl.program_id(1)
    cols = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < N
    acc = tl.zeros([BLOCK], tl.float32)
    # Always split 0 first, then 1, ...: the fixed order is what makes the result reproducible.
    for s in tl.static_range(SPLIT_K):
        acc += tl.load(partial_ptr + s * stride_ps + m * N + cols, mask=mask, other=0.0)
    if HAS_SCALE:
        acc *= tl.load(scale_ptr + cols, mask=mask, other=0.0)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + m * stride_om + cols, acc.to(out_ptr.dtype.element_ty), mask=mask)


def split_target(out: torch.Tensor, split_k: int) -> tuple[torch.Tensor, int, int]:
    """Where a GEMV split ``split_k`` ways along K writes: ``out`` itself unsplit, else a float32 partial buffer
    [split_k, M, N] for :func:`reduce_splits`; with the strides of its rows and of its splits."""
    if split_k < 1:
        raise ValueError(f"split_k must be >= 1, got {split_k}")
    if split_k == 1:
        return out, out.stride(0), 0
    m, n = out.shape
    return torch.empty(split_k, m, n, dtype=torch.float32, device=out.device), n, m * n


def reduce_splits(target: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor, split_k: int,
                  use_pdl: bool, scale: torch.Tensor | None = None) -> None:
    """``out`` = the splits of ``target`` added in a fixed order, times ``scale`` (per output column), plus ``bias``;
    nothing to do unsplit."""
    if split_k == 1:
        return
    m, n = out.shape
    _split_k_reduce_kernel[(triton.cdiv(n, _REDUCE_BLOCK), m)](
        target, scale if scale is not None else target, bias if bias is not None else target, out, n, m * n,
        out.stride(0), HAS_SCALE=scale is not None, HAS_BIAS=bias is not None, SPLIT_K=split_k,
        BLOCK=_REDUCE_BLOCK, USE_PDL=use_pdl,
        **launch_options(use_pdl),
    )


def gemv(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    *,
    split_k: int | None = None,
    pdl: bool | None = None,
    weight_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """``x @ weight.T + bias`` in ``x``'s dtype for ``x`` [M, K] and ``weight`` [N, K]; returns ``out`` [M, N].

    ``weight`` may be float8 e4m3 with ``weight_scale`` (float32 [N]), one scale per row: the product is then
    ``(x @ weight.T) * weight_scale + bias``, the fp8 weight read as it is (a byte a weight) and widened in registers.

    Meant for M <= 8 (larger M runs in chunks of 8 rows, each re-reading ``weight``: use a GEMM there).
    ``x`` and ``out`` may have strided rows; their columns, and ``weight``'s, must be contiguous.

    :param split_k: splits of K; :func:`choose_split_k` when None. Results depend on it in the last bits.
    :param pdl: launch with programmatic dependent launch, the first weight tile loaded before waiting for the
        previous kernel (:mod:`rtx_kernels.pdl`); None: where the device supports it. Where it does not (the
        interpreter), True still runs the prefetching variant, without the wait.
    """
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"x {tuple(x.shape)} and weight {tuple(weight.shape)} are not [M, K] and [N, K]")
    m, k = x.shape
    n = weight.shape[0]
    if weight.stride(1) != 1:
        raise ValueError("weight must be contiguous along K")
    if bias is not None and (bias.shape != (n,) or bias.stride(0) != 1):
        raise ValueError(f"bias {tuple(bias.shape)} must be a contiguous [{n}]")
    if weight_scale is not None and (weight_scale.shape != (n,) or weight_scale.dtype != torch.float32
                                     or weight_scale.stride(0) != 1):
        raise ValueError(f"weight_scale {tuple(weight_scale.shape)} {weight_scale.dtype} must be a contiguous [{n}] "
                         f"float32")
    if out is None:
        out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    elif out.shape != (m, n) or out.dtype != x.dtype or out.stride(1) != 1:
        raise ValueError(f"out {tuple(out.shape)} {out.dtype} must be [{m}, {n}] {x.dtype} with contiguous rows")
    if x.stride(1) != 1:
        x = x.contiguous()
    if m == 0 or n == 0:
        return out
    if split_k is None:
        sms = _num_sms(x.device.index or 0) if x.is_cuda else 132
        split_k = choose_split_k(n, k, sms)
    if split_k < 1:
        raise ValueError(f"split_k must be >= 1, got {split_k}")

    prefetch, use_pdl = gemv_launch_mode(x.device, pdl)
    for m0 in range(0, m, _MAX_M):
        _launch(x[m0 : m0 + _MAX_M], weight, weight_scale, bias, out[m0 : m0 + _MAX_M], split_k, prefetch,
                use_pdl)
    return out


def _launch(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor | None, bias: torch.Tensor | None,
            out: torch.Tensor, split_k: int, prefetch: bool, use_pdl: bool):
    m, k = x.shape
    n = weight.shape[0]
    target, stride_om, stride_os = split_target(out, split_k)
    _gemv_kernel[lambda meta: (triton.cdiv(n, meta["BLOCK_N"]), split_k)](
        x, weight, scale if scale is not None else x, bias if bias is not None else weight, target,
        m, n, k,
        x.stride(0), weight.stride(0), stride_om, stride_os,
        HAS_SCALE=scale is not None, HAS_BIAS=bias is not None, BLOCK_M=triton.next_power_of_2(m), SPLIT_K=split_k,
        PREFETCH=prefetch, USE_PDL=use_pdl, **launch_options(use_pdl),
    )
    reduce_splits(target, bias, out, split_k, use_pdl, scale)
