"""Weight-only quantized formats in plain torch: packing, dequantization and the CPU linear layers.

No Triton here: CPU-only installs may not have it. Dimension 0 of every tensor is the output features N.

- int8, per output channel, symmetric: ``weight`` int8 [N, K], ``scale`` float32 [N];
  ``W = weight * scale[:, None]``.
- int4, asymmetric groups of ``group_size`` columns along K: ``packed`` int32 [N, K/8], word i holding columns
  8i..8i+7, column 8i+j in bits 4j..4j+3 (unsigned nibbles); ``scale`` float32 [N, K/G], ``zero`` uint8 [N, K/G]
  (0..15); ``W[n, k] = (q[n, k] - zero[n, k // G]) * scale[n, k // G]``.

``y = x @ W.T (+ bias)`` in ``x``'s dtype.
"""

from __future__ import annotations

import importlib.util

import torch
import torch.nn.functional as F

# Without Triton, CUDA tensors take the dequantize-then-matmul path too.
HAS_TRITON = importlib.util.find_spec("triton") is not None

_NIBBLE_SHIFTS = tuple(range(0, 32, 4))


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """uint8 ``q`` [N, K] of values 0..15 (K a multiple of 8) -> int32 [N, K/8]."""
    n, k = q.shape
    if k % 8:
        raise ValueError(f"K={k} is not a multiple of 8")
    nibbles = q.to(torch.int32).view(n, k // 8, 8)
    packed = torch.zeros(n, k // 8, dtype=torch.int32, device=q.device)
    for j, shift in enumerate(_NIBBLE_SHIFTS):
        # Nibble 7 lands in the sign bit: the OR keeps the bits, the int32 just reads negative.
        packed |= nibbles[..., j] << shift
    return packed


def unpack_int4(packed: torch.Tensor, k: int) -> torch.Tensor:
    """int32 [N, K/8] -> uint8 [N, K]: the inverse of :func:`pack_int4`."""
    n, num_words = packed.shape
    if num_words * 8 != k:
        raise ValueError(f"packed {tuple(packed.shape)} does not hold {k} columns")
    shifts = torch.tensor(_NIBBLE_SHIFTS, dtype=torch.int32, device=packed.device)
    # >> on int32 is arithmetic: the mask drops the sign bits it drags into the top nibble.
    return ((packed.unsqueeze(-1) >> shifts) & 0xF).to(torch.uint8).view(n, k)


def dequantize_int8(weight: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``weight * scale[:, None]`` computed in float32, returned in ``dtype`` [N, K]."""
    return (weight.float() * scale.float()[:, None]).to(dtype)


def dequantize_int4(packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, group_size: int,
                    dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``(q - zero) * scale`` per group, computed in float32, returned in ``dtype`` [N, K]."""
    n, num_groups = scale.shape
    k = packed.shape[1] * 8
    if num_groups * group_size != k or zero.shape != scale.shape:
        raise ValueError(f"scale {tuple(scale.shape)} / zero {tuple(zero.shape)} do not cover K={k} in groups of "
                         f"{group_size}")
    q = unpack_int4(packed, k).view(n, num_groups, group_size).float()
    w = (q - zero.float().unsqueeze(-1)) * scale.float().unsqueeze(-1)
    return w.view(n, k).to(dtype)


def _int8pack_mm_applies(x: torch.Tensor, weight: torch.Tensor) -> bool:
    # aten's CPU kernel (int8mm_kernel.cpp) is vectorized for bfloat16 only; in float32 and float16 it falls back
    # to a scalar loop 10-50x slower than dequantize-then-matmul. It steps through K 16 columns at a time with no
    # tail and assumes contiguous rows (lda = K) and aligned vector loads: K % 16 == 0, contiguous operands and
    # aligned base pointers, else it reads past rows, returns garbage or segfaults (seen with torch 2.13).
    return (hasattr(torch, "_weight_int8pack_mm") and x.dtype == torch.bfloat16 and x.shape[1] % 16 == 0
            and weight.is_contiguous() and weight.data_ptr() % 64 == 0)


def int8_linear_cpu(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
                    bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ (weight * scale[:, None]).T + bias`` for ``x`` [M, K]; returns [M, N] in ``x``'s dtype.

    In bfloat16 this is aten's fused int8 kernel, which reads the int8 weight directly (on a 2-core AVX2 machine,
    N=K=2048: 0.2 ms at M=1 against 1.4 ms for dequantize-then-matmul, 20 ms against 80 ms at M=128). It rounds the
    scale to bfloat16 and the result once; that stays within bfloat16's own rounding. Otherwise the weight is
    dequantized to float32 and multiplied in float32, which on CPUs without bf16 matrix units is also faster than
    a 16-bit matmul.
    """
    if _int8pack_mm_applies(x, weight):
        if not x.is_contiguous() or x.data_ptr() % 64:
            x = x.clone(memory_format=torch.contiguous_format)  # a fresh allocation is 64-byte aligned
        y = torch._weight_int8pack_mm(x, weight, scale.to(torch.bfloat16))
        return y if bias is None else (y.float() + bias.float()).to(y.dtype)
    return _dequantized_linear(x, dequantize_int8(weight, scale), bias)


def int4_linear_cpu(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor,
                    group_size: int, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ dequantize_int4(...).T + bias`` for ``x`` [M, K]; returns [M, N] in ``x``'s dtype.

    Dequantize-then-matmul in float32. aten's ``_weight_int4pack_mm_for_cpu`` wants its own weight layout, and
    converting to it (``_convert_weight_to_int4pack_for_cpu``) cost more per call than this whole dequantization
    (6 ms against 3 ms at N=K=2048, 2 cores); it would only pay with the converted weight kept from load time,
    which this format does not carry.
    """
    return _dequantized_linear(x, dequantize_int4(packed, scale, zero, group_size), bias)


def _dequantized_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    y = F.linear(x.float(), weight, None if bias is None else bias.float())
    return y.to(x.dtype)
