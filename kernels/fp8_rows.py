"""Per-row (per-token) fp8 e4m3 quantization of activations in one kernel: ``q, scale`` with ``scale[m]`` =
max |x[m, :]| * (1 / 448) and ``q[m, k]`` = x[m, k] / scale[m] rounded to e4m3, the rounding of
``plugins/quantizers/fp8.py``'s ``quantize_rows`` (IEEE division, round to nearest even, saturating).

Done with torch operations, the same takes about eight kernels per linear layer (absolute value, row maximum,
clamp, division, casts), each a launch and a pass over ``x``; at one token per step that cost more than the fp8
product saved. Here each program owns a row: one pass finds its maximum, a second writes the fp8 values.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max  # 448
_BLOCK_K = 1024


@triton.jit
def _quantize_rows_kernel(x_ptr, q_ptr, scale_ptr, K, stride_xm, stride_qm,
                          FP8_MAX: tl.constexpr, BLOCK_K: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_K)
    x_row = x_ptr + row * stride_xm
    amax = tl.zeros([BLOCK_K], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        x = tl.load(x_row + k0 + cols, mask=k0 + cols < K, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(x))
    # The scale times the reciprocal, as the quantizer; x over it by IEEE division, as torch divides one tensor by
    # another (Triton's ``/`` on float32 is an approximate one on NVIDIA GPUs).
    scale = tl.maximum(tl.max(amax, axis=0), 1e-12) * (1.0 / FP8_MAX)
    tl.store(scale_ptr + row, scale)
    for k0 in range(0, K, BLOCK_K):
        mask = k0 + cols < K
        x = tl.load(x_row + k0 + cols, mask=mask, other=0.0).to(tl.float32)
        q = tl.clamp(tl.math.div_rn(x, scale), -FP8_MAX, FP8_MAX)
        tl.store(q_ptr + row * stride_qm + k0 + cols, _e4m3_bits(q), mask=mask)


@triton.jit
def _e4m3_bits(v):
    """The e4m3fn byte of float32 ``v`` (|v| <= 448), rounded to nearest even, from integer operations: the same
    bits on the GPU and in Triton's interpreter, whose own fp8 cast loses the carry into the exponent."""
    b = v.to(tl.int32, bitcast=True)
    a = tl.abs(v)
    # Normal: keep 3 mantissa bits, round half to even (the carry may go into the exponent), rebias 127 -> 7.
    normal = ((b & 0x7FFFFFFF) + 0x7FFFF + ((b >> 20) & 1)) >> 20
    normal = normal - ((127 - 7) << 3)
    # Below 2^-6, multiples of 2^-9: a * 2^9 rounded half to even by adding and removing 2^23.
    sub = ((a * 512.0 + 8388608.0) - 8388608.0).to(tl.int32)
    bits = tl.where(a >= 0.015625, normal, sub)
    return (bits | ((b >> 24) & 0x80)).to(tl.uint8)


def quantize_rows_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp8 e4m3 [M, K], float32 scales [M, 1]) for ``x`` [M, K] in float32, float16 or bfloat16 (rows may be
    strided, K contiguous)."""
    if x.dim() != 2 or x.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"x {tuple(x.shape)} {x.dtype} must be [M, K] in float32, float16 or bfloat16")
    if x.stride(1) != 1:
        x = x.contiguous()
    m, k = x.shape
    q = torch.empty(m, k, dtype=torch.uint8, device=x.device)
    scale = torch.empty(m, 1, dtype=torch.float32, device=x.device)
    if m and k:
        _quantize_rows_kernel[(m,)](x, q, scale, k, x.stride(0), q.stride(0), FP8_MAX=FP8_MAX,
                                    BLOCK_K=min(_BLOCK_K, triton.next_power_of_2(k)), num_warps=4)
    return q.view(FP8), scale
