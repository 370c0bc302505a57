"""Dequantizing int8 and int4 weights (the formats of :mod:`rtx_kernels.quant_reference`) in Triton: a weight tile
in registers, which the tiled GEMM of :mod:`rtx_kernels.quant_matmul` feeds to ``tl.dot``, and a whole layer into a
scratch buffer, after which cuBLAS runs the product (the path large batches and prefill chunks take).

The scratch is one buffer per device and dtype, as large as the largest layer seen so far, reused by every layer
(kernels run in stream order). A buffer it outgrows is kept, not freed: CUDA graphs captured with it replay into it.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def dequantize_int4_tile(w_ptrs, scale_ptr, zero_ptr, rn_c, stride_sn, k0, K, rk, dtype,
                          GROUP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr):
    """W[rn, k0:k0 + BLOCK_K] in ``dtype``, [BLOCK_N, BLOCK_K]."""
    if EVEN_K:
        words = tl.load(w_ptrs + k0 // 8)
    else:
        words = tl.load(w_ptrs + k0 // 8, mask=(k0 // 8 + tl.arange(0, BLOCK_K // 8) < K // 8)[None, :], other=0)
    # 0x4B000000 | q is the float 2^23 + q, exact; subtracting 2^23 + z leaves q - z without a cvt.
    q = ((words[:, :, None] >> (tl.arange(0, 8) * 4)[None, None, :]) & 0xF) | 0x4B000000
    q = tl.reshape(q, [BLOCK_N, BLOCK_K]).to(tl.float32, bitcast=True)
    if GROUP % BLOCK_K == 0:
        # The whole tile lies in one group: one scale and zero per row.
        s_ptrs = scale_ptr + rn_c * stride_sn + k0 // GROUP
        z_ptrs = zero_ptr + rn_c * stride_sn + k0 // GROUP
        s = tl.load(s_ptrs)[:, None]
        z = tl.load(z_ptrs).to(tl.float32)[:, None] + 8388608.0
    else:
        group = ((k0 + rk) // GROUP)[None, :]
        mask = (k0 + rk < K)[None, :]
        s = tl.load(scale_ptr + rn_c[:, None] * stride_sn + group, mask=mask, other=0.0)
        z = tl.load(zero_ptr + rn_c[:, None] * stride_sn + group, mask=mask, other=0).to(tl.float32) + 8388608.0
    return ((q - z) * s).to(dtype)


@triton.jit
def _dequantize_kernel(w_ptr, scale_ptr, zero_ptr, out_ptr, N, K, stride_wn, stride_sn, stride_on,
                       BITS: tl.constexpr, GROUP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rn_c = tl.minimum(rn, N - 1)
    rk = tl.arange(0, BLOCK_K)
    k0 = tl.program_id(1) * BLOCK_K
    if BITS == 8:
        q = tl.load(w_ptr + rn_c.to(tl.int64)[:, None] * stride_wn + k0 + rk[None, :],
                    mask=(k0 + rk < K)[None, :], other=0)
        w = (q.to(tl.float32) * tl.load(scale_ptr + rn_c)[:, None]).to(out_ptr.dtype.element_ty)
    else:
        w_ptrs = w_ptr + rn_c.to(tl.int64)[:, None] * stride_wn + tl.arange(0, BLOCK_K // 8)[None, :]
        w = dequantize_int4_tile(w_ptrs, scale_ptr, zero_ptr, rn_c, stride_sn, k0, K, rk,
                                  out_ptr.dtype.element_ty, GROUP, BLOCK_N, BLOCK_K, False)
    out_ptrs = out_ptr + rn.to(tl.int64)[:, None] * stride_on + k0 + rk[None, :]
    tl.store(out_ptrs, w, mask=(rn < N)[:, None] & (k0 + rk < K)[None, :])


# (device, dtype) -> the flat scratch buffer the weights are dequantized into; grows to the largest layer.
_scratch: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}
# Buffers outgrown, never freed: a CUDA graph captured while one was current writes to it on every replay (a decode
# graph captured before any layer took this path, say, then a larger layer grew the buffer).
_retired_scratch: list[torch.Tensor] = []


def _scratch_weight(n: int, k: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    buffer = _scratch.get((device, dtype))
    if buffer is None or buffer.numel() < n * k:
        if buffer is not None:
            _retired_scratch.append(buffer)
        buffer = _scratch[(device, dtype)] = torch.empty(n * k, dtype=dtype, device=device)
    return buffer[: n * k].view(n, k)


def dequantized_matmul(x, weight, scale, zero, bias, out, *, bits: int, group: int):
    k = x.shape[1]
    n = weight.shape[0]
    w = _scratch_weight(n, k, x.dtype, x.device)
    # int4 tiles lie inside one group, one scale and zero point per row: the largest power of 2 dividing it.
    block_k = min(128, group & -group) if bits == 4 else 128
    block_n = 16 if _INTERPRET else 32
    _dequantize_kernel[(triton.cdiv(n, block_n), triton.cdiv(k, block_k))](
        weight, scale, zero, w, n, k, weight.stride(0), scale.stride(0) if bits == 4 else 0, w.stride(0),
        BITS=bits, GROUP=group, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=4,
    )
    if bias is None:
        torch.mm(x, w.t(), out=out)
    else:
        torch.addmm(bias.to(x.dtype), x, w.t(), out=out)
