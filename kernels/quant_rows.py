"""Per-row (per-token) quantization of activations in one kernel, to fp8 e4m3 or int8: ``q, scale`` with
``scale[m]`` = max |x[m, :]| * (1 / LEVELS) and ``q[m, k]`` = x[m, k] / scale[m] rounded, the rounding of the
quantizers' torch code (IEEE division, round to nearest even, saturating): ``quantize_rows`` in
``plugins/quantizers/fp8.py`` (LEVELS 448) and ``quantize_rows_int8`` in ``plugins/quantizers/int8_sq.py`` (LEVELS
127). For int8 each column may first be divided by a divisor of its own (int8-sq's smoothing), as the quantizer
divides ``x`` before it rounds.

Done with torch operations, the same takes about eight kernels per linear layer (absolute value, row maximum,
clamp, division, casts), each a launch and a pass over ``x``; at one token per step that cost more than the fp8
product saved. Here each program owns a row. A row of up to 16,384 values is loaded once and kept in registers
while its maximum is found and its quantized values written; a longer one is read twice, in tiles.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max  # 448
# FP8_MAX as a Triton constant, for the kernels that round their own output per row (rmsnorm, activation).
FP8_LEVELS = tl.constexpr(FP8_MAX)
INT8_LEVELS = 127
_BLOCK_K = 1024
# Rows up to this long are loaded once (one tile of the whole row): every linear layer's input of the Llama shapes.
ONE_PASS_MAX_K = 16384
# Added to and taken from a float32 of magnitude below 2^22, rounds it to an integer, ties to even.
_ROUNDING = tl.constexpr(12582912.0)  # 1.5 * 2^23
# A quiet NaN's bits: a NaN constexpr cannot be a global (NaN != NaN, so Triton takes it for a changed global and
# refuses to launch the compiled kernel).
_NAN_BITS = tl.constexpr(0x7FC00000)


@triton.jit
def _quantize_rows_kernel(x_ptr, divisor_ptr, q_ptr, scale_ptr, K, stride_xm, stride_qm,
                          LEVELS: tl.constexpr, INT8: tl.constexpr, HAS_DIVISOR: tl.constexpr,
                          BLOCK_K: tl.constexpr, ONE_PASS: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_K)
    x_row = x_ptr + row * stride_xm
    if ONE_PASS:  # BLOCK_K >= K: the whole row in one tile, read once
        x = _load_row(x_row, divisor_ptr, cols, K, HAS_DIVISOR)
        scale = row_scale(tl.abs(x), (x != x).to(tl.int32), LEVELS)
        tl.store(scale_ptr + row, scale)
        tl.store(q_ptr + row * stride_qm + cols, quantize_values(x, scale, LEVELS, INT8), mask=cols < K)
    else:  # tiles of BLOCK_K: one pass for the maximum, a second for the values
        amax = tl.zeros([BLOCK_K], tl.float32)
        nans = tl.zeros([BLOCK_K], tl.int32)
        for k0 in range(0, K, BLOCK_K):
            x = _load_row(x_row, divisor_ptr, k0 + cols, K, HAS_DIVISOR)
            amax = tl.maximum(amax, tl.abs(x))
            nans += (x != x).to(tl.int32)
        scale = row_scale(amax, nans, LEVELS)
        tl.store(scale_ptr + row, scale)
        for k0 in range(0, K, BLOCK_K):
            x = _load_row(x_row, divisor_ptr, k0 + cols, K, HAS_DIVISOR)
            tl.store(q_ptr + row * stride_qm + k0 + cols, quantize_values(x, scale, LEVELS, INT8), mask=k0 + cols < K)


@triton.jit
def row_scale(amax, nans, LEVELS: tl.constexpr):
    # The scale times the reciprocal, as the quantizers; x over it by IEEE division, as torch divides one tensor by
    # another (Triton's ``/`` on float32 is an approximate one on NVIDIA GPUs). tl.maximum passes over NaN where
    # torch's row maximum is NaN: a row holding one gets a NaN scale, so the layer's output shows it, as on the CPU.
    scale = tl.maximum(tl.max(amax, axis=0), 1e-12) * (1.0 / LEVELS)
    nan = tl.full([], _NAN_BITS, tl.int32).to(tl.float32, bitcast=True)
    return tl.where(tl.sum(nans, axis=0) > 0, nan, scale)


@triton.jit
def quantize_values(x, scale, LEVELS: tl.constexpr, INT8: tl.constexpr):
    q = tl.clamp(tl.math.div_rn(x, scale), -LEVELS, LEVELS)
    # One return: written with a return in each constexpr branch, the int8 values came out wrong on an H100 (every
    # int8 test, 2026-12-06) and right in Triton's interpreter, as if the int8 result took the fp8 branch's uint8.
    if INT8:
        out = ((q + _ROUNDING) - _ROUNDING).to(tl.int8)
    else:
        out = e4m3_bits(q)
    return out


@triton.jit
def _load_row(x_row, divisor_ptr, cols, K, HAS_DIVISOR: tl.constexpr):
    mask = cols < K
    x = tl.load(x_row + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_DIVISOR:
        x = tl.math.div_rn(x, tl.load(divisor_ptr + cols, mask=mask, other=1.0))
    return x


@triton.jit
def e4m3_bits(v):
    """The e4m3fn byte of float32 ``v`` (|v| <= 448), rounded to nearest even, from integer operations: the same
    bits on the GPU and in Triton's interpreter, whose own fp8 cast loses the carry into the exponent (1.96 became
    1.0). The rotary kernel's fp8 KV store uses it too."""
    b = v.to(tl.int32, bitcast=True)
    a = tl.abs(v)
    # Normal: keep 3 mantissa bits, round half to even (the carry may go into the exponent), rebias 127 -> 7.
    normal = ((b & 0x7FFFFFFF) + 0x7FFFF + ((b >> 20) & 1)) >> 20
    normal = normal - ((127 - 7) << 3)
    # Below 2^-6, multiples of 2^-9: a * 2^9 rounded half to even by adding and removing 2^23.
    sub = ((a * 512.0 + 8388608.0) - 8388608.0).to(tl.int32)
    bits = tl.where(a >= 0.015625, normal, sub)
    return (bits | ((b >> 24) & 0x80)).to(tl.uint8)


def row_warps(block: int) -> int:
    """Warps for a program holding a row tile of ``block`` values: a warp per 512 (16 a thread in registers), from 4
    to 16."""
    return max(4, min(16, block // 512))


def quantize_rows_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp8 e4m3 [M, K], float32 scales [M, 1]) for ``x`` [M, K] in float32, float16 or bfloat16 (rows may be
    strided, K contiguous). A row holding NaN gets a NaN scale (its values are then meaningless)."""
    q, scale = _quantize_rows(x, None, torch.uint8, FP8_MAX)
    return q.view(FP8), scale


def quantize_rows_int8(x: torch.Tensor, divisor: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 [M, K], float32 scales [M, 1]) for ``x`` [M, K] in float32, float16 or bfloat16 (rows may be strided, K
    contiguous), each column divided first by ``divisor`` (float32 [K]) where given. A row holding NaN gets a NaN
    scale (its values are then meaningless)."""
    if divisor is not None and (divisor.shape != (x.shape[-1],) or divisor.dtype != torch.float32
                                or divisor.device != x.device):
        raise ValueError(f"divisor {tuple(divisor.shape)} {divisor.dtype} must be float32 [{x.shape[-1]}] on "
                         f"{x.device}")
    return _quantize_rows(x, divisor.contiguous() if divisor is not None else None, torch.int8, INT8_LEVELS)


def _quantize_rows(x: torch.Tensor, divisor: torch.Tensor | None, dtype: torch.dtype,
                   levels: int | float) -> tuple[torch.Tensor, torch.Tensor]:
    if x.dim() != 2 or x.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"x {tuple(x.shape)} {x.dtype} must be [M, K] in float32, float16 or bfloat16")
    if x.stride(1) != 1:
        x = x.contiguous()
    m, k = x.shape
    q = torch.empty(m, k, dtype=dtype, device=x.device)
    scale = torch.empty(m, 1, dtype=torch.float32, device=x.device)
    if m and k:
        one_pass = k <= ONE_PASS_MAX_K
        block_k = triton.next_power_of_2(k) if one_pass else _BLOCK_K
        _quantize_rows_kernel[(m,)](x, divisor if divisor is not None else x, q, scale, k, x.stride(0), q.stride(0),
                                    LEVELS=levels, INT8=dtype == torch.int8, HAS_DIVISOR=divisor is not None,
                                    BLOCK_K=block_k, ONE_PASS=one_pass, num_warps=row_warps(block_k))
    return q, scale
