"""Rotary position embedding applied in place to q and k, in Triton, one program per token.

``q`` is ``[T, H, D]`` and ``k`` ``[T, KVH, D]``; both may be strided views (typically slices of the packed qkv
projection ``[T, (H + 2 * KVH) * D]``), so only the last dimension must be contiguous. ``positions`` is int64
``[T]``; ``cos`` / ``sin`` are float32 ``[max_pos, D / 2]`` tables. The layout is HF Llama's half rotation: the
first and second halves of each head are the pair being rotated,
``out = cat(x1 * cos - x2 * sin, x2 * cos + x1 * sin)``, computed in fp32 and rounded back to the input's dtype.

Given the paged caches ``[KVH, num_blocks, block_size, D]`` and ``slot_mapping`` (int64 ``[T]``,
``block_id * block_size + offset``), the same launch also stores the rotated k and the untouched v ``[T, KVH, D]``
of each token into its slot (rounded to fp8 when the caches are :data:`FP8_KV_DTYPE`), which saves the two
``index_copy_`` launches per layer that dominate a batch-1 decode step. Tokens sharing a slot (CUDA-graph padding
rows all point at the null block's slot 0) race; any may win.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from rtx_kernels.pdl import launch_options, pdl_enabled, wait_for_previous
from rtx_kernels.quant_rows import e4m3_bits

# The dtype of an fp8 KV cache: e4m3 (3 mantissa bits, finite up to 448), the format vLLM's and TensorRT-LLM's
# "fp8" caches use too; keys and values are stored unscaled.
FP8_KV_DTYPE = torch.float8_e4m3fn


@triton.jit
def _head_offsets(stride_h, num_heads, HALF: tl.constexpr, HEADS_PAD: tl.constexpr, HALF_PAD: tl.constexpr):
    # int64: a cache's head stride times the head index can pass 2**31.
    heads = tl.arange(0, HEADS_PAD).to(tl.int64)
    cols = tl.arange(0, HALF_PAD)
    mask = (heads < num_heads)[:, None] & (cols < HALF)[None, :]
    return heads[:, None] * stride_h + cols[None, :], mask


@triton.jit
def _rotate_heads(x_ptr, offs, mask, cos, sin, HALF: tl.constexpr):
    """Rotates in place; returns the rotated halves in fp32, so a cache of another dtype rounds them only once."""
    first = x_ptr + offs
    x1 = tl.load(first, mask=mask, other=0.0)
    x2 = tl.load(first + HALF, mask=mask, other=0.0)
    x1f = x1.to(tl.float32)
    x2f = x2.to(tl.float32)
    y1 = x1f * cos - x2f * sin
    y2 = x2f * cos + x1f * sin
    tl.store(first, y1.to(x1.dtype), mask=mask)
    tl.store(first + HALF, y2.to(x1.dtype), mask=mask)
    return y1, y2


@triton.jit
def _cache_value(x, cache_ptr, FP8_CACHE: tl.constexpr):
    """``x`` as the cache stores it. An fp8 (e4m3) cache, passed as its bytes, holds values unscaled, saturated at
    its largest finite value, rounded to nearest even (by :func:`e4m3_bits`, which Triton's interpreter, running
    these kernels in CI, rounds as the GPU does)."""
    if FP8_CACHE:
        return e4m3_bits(tl.clamp(x.to(tl.float32), -448.0, 448.0))
    return x.to(cache_ptr.dtype.element_ty)


@triton.jit
def _rotary_kernel(
    q_ptr, k_ptr, positions_ptr, cos_ptr, sin_ptr,
    v_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_cos, stride_sin,
    stride_vt, stride_vh, stride_ch, stride_cb, stride_cs, block_size,
    num_q_heads, num_k_heads,
    HALF: tl.constexpr, HALF_PAD: tl.constexpr, Q_HEADS_PAD: tl.constexpr, K_HEADS_PAD: tl.constexpr,
    WRITE_CACHE: tl.constexpr, FP8_CACHE: tl.constexpr, USE_PDL: tl.constexpr,
):
    wait_for_previous(USE_PDL)
    token = tl.program_id(0).to(tl.int64)
    pos = tl.load(positions_ptr + token)
    cols = tl.arange(0, HALF_PAD)
    col_mask = cols < HALF
    cos = tl.load(cos_ptr + pos * stride_cos + cols, mask=col_mask, other=0.0)[None, :]
    sin = tl.load(sin_ptr + pos * stride_sin + cols, mask=col_mask, other=0.0)[None, :]
    q_offs, q_mask = _head_offsets(stride_qh, num_q_heads, HALF, Q_HEADS_PAD, HALF_PAD)
    _rotate_heads(q_ptr + token * stride_qt, q_offs, q_mask, cos, sin, HALF)
    k_offs, kv_mask = _head_offsets(stride_kh, num_k_heads, HALF, K_HEADS_PAD, HALF_PAD)
    k1, k2 = _rotate_heads(k_ptr + token * stride_kt, k_offs, kv_mask, cos, sin, HALF)
    if WRITE_CACHE:
        slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
        c_offs, _ = _head_offsets(stride_ch, num_k_heads, HALF, K_HEADS_PAD, HALF_PAD)
        c_offs += (slot // block_size) * stride_cb + (slot % block_size) * stride_cs
        tl.store(k_cache_ptr + c_offs, _cache_value(k1, k_cache_ptr, FP8_CACHE), mask=kv_mask)
        tl.store(k_cache_ptr + c_offs + HALF, _cache_value(k2, k_cache_ptr, FP8_CACHE), mask=kv_mask)
        v_offs, _ = _head_offsets(stride_vh, num_k_heads, HALF, K_HEADS_PAD, HALF_PAD)
        v_row = v_ptr + token * stride_vt + v_offs
        v1 = tl.load(v_row, mask=kv_mask)
        v2 = tl.load(v_row + HALF, mask=kv_mask)
        tl.store(v_cache_ptr + c_offs, _cache_value(v1, v_cache_ptr, FP8_CACHE), mask=kv_mask)
        tl.store(v_cache_ptr + c_offs + HALF, _cache_value(v2, v_cache_ptr, FP8_CACHE), mask=kv_mask)


def apply_rotary(
    q: torch.Tensor,
    k: torch.Tensor,
    positions: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    v: torch.Tensor | None = None,
    k_cache: torch.Tensor | None = None,
    v_cache: torch.Tensor | None = None,
    slot_mapping: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate ``q`` [T, H, D] and ``k`` [T, KVH, D] in place by ``positions``; returns ``(q, k)``.

    With ``v``, ``k_cache``, ``v_cache`` and ``slot_mapping`` all given, also writes the rotated k and v into the
    caches' slots."""
    num_tokens, num_q_heads, head_size = q.shape
    num_k_heads = k.shape[1]
    if head_size % 2 or k.shape[2] != head_size or cos.shape[-1] != head_size // 2:
        raise ValueError(f"q {tuple(q.shape)}, k {tuple(k.shape)} and cos {tuple(cos.shape)} disagree")
    cache_args = (v, k_cache, v_cache, slot_mapping)
    write_cache = all(t is not None for t in cache_args)
    if not write_cache and any(t is not None for t in cache_args):
        raise ValueError("v, k_cache, v_cache and slot_mapping go together")
    named = [("q", q), ("k", k), ("cos", cos), ("sin", sin)]
    if write_cache:
        named += [("v", v), ("k_cache", k_cache), ("v_cache", v_cache)]
        if v.shape != k.shape or slot_mapping.shape != (num_tokens,):
            raise ValueError(f"v {tuple(v.shape)} / slot_mapping {tuple(slot_mapping.shape)} do not match k")
        # One set of cache strides serves both caches.
        if (k_cache.shape != v_cache.shape or k_cache.stride() != v_cache.stride()
                or k_cache.shape[0] != num_k_heads or k_cache.shape[3] != head_size):
            raise ValueError(f"caches {tuple(k_cache.shape)} / {tuple(v_cache.shape)} do not match k")
        # The cache holds k and v in their own dtype, or in fp8 (a --kv-cache-dtype fp8 cache); attention then
        # reads every key, the current chunk's too, from the cache.
        if k.dtype != v.dtype or k_cache.dtype != v_cache.dtype or k_cache.dtype not in (k.dtype, FP8_KV_DTYPE):
            raise ValueError(f"k {k.dtype} / v {v.dtype} cannot be stored in caches of {k_cache.dtype} / "
                             f"{v_cache.dtype}")
    for name, t in named:
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in its last dimension")
    if num_tokens:
        half = head_size // 2
        fp8_cache = write_cache and k_cache.dtype == FP8_KV_DTYPE
        if write_cache:
            cache_strides = (v.stride(0), v.stride(1), *k_cache.stride()[:3], k_cache.shape[2])
            if fp8_cache:  # stored as the bytes e4m3_bits makes (the strides stay: one byte an element)
                k_cache, v_cache = k_cache.view(torch.uint8), v_cache.view(torch.uint8)
        else:
            v = k_cache = v_cache = slot_mapping = k  # never read: WRITE_CACHE prunes their uses
            cache_strides = (0,) * 6
        use_pdl = pdl_enabled(q.device)
        _rotary_kernel[(num_tokens,)](
            q, k, positions, cos, sin, v, k_cache, v_cache, slot_mapping,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), cos.stride(0), sin.stride(0), *cache_strides,
            num_q_heads, num_k_heads,
            HALF=half, HALF_PAD=triton.next_power_of_2(half),
            Q_HEADS_PAD=triton.next_power_of_2(num_q_heads), K_HEADS_PAD=triton.next_power_of_2(num_k_heads),
            WRITE_CACHE=write_cache, FP8_CACHE=fp8_cache, USE_PDL=use_pdl,
            **launch_options(use_pdl),
        )
    return q, k
