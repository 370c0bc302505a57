"""Paged decode attention (one new query token per request) as a two-stage split-K Triton kernel.

Layouts:
- ``q``: ``[B, H, D]``, one token per request; ``H = KVH * group`` (grouped-query attention).
- ``k_cache`` / ``v_cache``: head-major paged ``[KVH, num_blocks, block_size, D]``, the engine's layout, so one kv
  head's blocks are contiguous. Block 0 is the engine's null block; it is only ever read under a mask. They hold
  ``q``'s dtype or fp8 (e4m3, unscaled), widened as tiles load: half the bytes to read (see ``fp8_cache``).
- ``block_tables``: int32 ``[B, max_blocks]`` padded with 0; ``seq_lens``: int32 ``[B]``, 0 for padding rows.

Stage 1 runs one program per (request, kv head, split). It loads each K/V tile once and scores it against all
``group`` query heads of that kv head with ``tl.dot`` (the group padded to 16 rows, the smallest MMA tile), so K/V
traffic is paid once per kv head instead of once per query head. Each split covers a contiguous range of blocks,
sized per request from its own ``seq_len``, and leaves an fp32 partial output and its log-sum-exp; stage 2 merges
the splits (flash-decoding). Small batches need the splits to fill the GPU's SMs; large ones do not split at all and
stage 1 writes the output directly.

The grid depends only on shapes and the host int ``num_splits``, never on tensor values, so a call can be captured
in a CUDA graph. Softmax runs in base 2 (``exp2``, the scale pre-multiplied by log2(e)); the stored log-sum-exp is
therefore base 2 too and only meaningful to stage 2.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from rtx_kernels.fp8_cache import dot_dtype, to_dot_dtype
from rtx_kernels.launch import launch
from rtx_kernels.pdl import launch_options, pdl_enabled, wait_for_previous

_LOG2E = 1.4426950408889634
# Keys per inner-loop tile, gathered through the block table; independent of the cache's block size. Unsplit
# programs walk whole contexts and do better with a larger tile: 16 KiB of keys. Two sweeps chose it
# (docs/benchmarks.md): on the H200 at llama-1b's heads (head size 64, bfloat16: 128 keys), W2 contexts, 16 layers'
# caches in one graph, 64 requests took 50.0 us per layer unsplit with 128 against 53.4 in 2 splits with 64, 128
# requests 87.2 against 93.6 unsplit with 64; on an H100 at llama-8b's (head size 128: 64 keys in bfloat16, 128 in
# fp8), 256 requests of 128-256 tokens took 74.5 us with 64 against 82.6 with 128 over a bfloat16 cache, and 69.0
# with 128 against 70.0 with 64 over an fp8 one (benchmarks/decode_attention_sweep.py, 2026-12-06). Split programs
# (32 requests: 27.4 us in 4 splits) gained nothing from it.
_BLOCK_N = 64
_UNSPLIT_TILE_BYTES = 16384
# Splits shorter than this many tokens cost more in the merge than they gain in parallelism.
_MIN_TOKENS_PER_SPLIT = 256
_MAX_SPLITS = 32
_PROGRAMS_PER_SM = 4


@dataclass(slots=True)
class DecodeWorkspace:
    """Scratch for the split path; allocate once for the largest batch to keep it out of the hot loop."""

    partial_out: torch.Tensor  # fp32 [max_batch, H, num_splits, D]: each split's normalised output
    partial_lse: torch.Tensor  # fp32 [max_batch, H, num_splits]: each split's base-2 log-sum-exp

    @classmethod
    def allocate(cls, max_batch: int, num_heads: int, num_splits: int, head_size: int,
                 device: torch.device | str) -> DecodeWorkspace:
        return cls(
            partial_out=torch.empty(max_batch, num_heads, num_splits, head_size, dtype=torch.float32, device=device),
            partial_lse=torch.empty(max_batch, num_heads, num_splits, dtype=torch.float32, device=device),
        )


def choose_num_splits(batch_size: int, num_kv_heads: int, max_seq_len_hint: int, num_sms: int = 132) -> int:
    """Splits per request so that ``batch_size * num_kv_heads * splits`` gives every SM about four programs.

    One program per SM is not enough: contexts differ in length, and the longest request's programs then run
    alone at the end. Measured on the H200 (a sweep, docs/benchmarks.md, 2026-11-29, llama-1b heads,
    contexts uniform in [100, 2048]): 32 requests took 54 us unsplit and 36 us in 4 splits; 64 requests 69 and
    64 us in 2; from 128 requests splitting gained little. From two programs per SM on, no split (see _BLOCK_N).
    A power of two, at most one split per 256 tokens.
    """
    programs = batch_size * num_kv_heads
    target = _PROGRAMS_PER_SM * num_sms
    # From two programs per SM on, one split with the larger tile beat two splits (64 requests: see _BLOCK_N).
    if 2 * programs >= target:
        return 1
    by_occupancy = triton.next_power_of_2(triton.cdiv(target, programs))
    by_length = max(1, max_seq_len_hint // _MIN_TOKENS_PER_SPLIT)
    return max(1, min(by_occupancy, by_length, _MAX_SPLITS))


def unsplit_block_n(head_size: int, itemsize: int) -> int:
    """Keys per tile of an unsplit program: :data:`_UNSPLIT_TILE_BYTES` of keys, 64 to 128 (the sizes measured)."""
    return max(_BLOCK_N, min(128, _UNSPLIT_TILE_BYTES // (head_size * itemsize)))


@triton.jit
def _decode_split_kernel(
    q_ptr, k_ptr, v_ptr, block_tables_ptr, seq_lens_ptr, out_ptr, lse_ptr,
    qk_scale, num_splits,
    stride_qb, stride_qh,
    stride_kh, stride_kb, stride_kt,
    stride_vh, stride_vb, stride_vt,
    stride_bt,
    stride_ob, stride_oh, stride_os,
    stride_lb, stride_lh,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_SIZE: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr, DIRECT: tl.constexpr, DOT_PRECISION: tl.constexpr, DOT_DTYPE: tl.constexpr,
    USE_PDL: tl.constexpr, PARTITION_BLOCKS: tl.constexpr,
):
    wait_for_previous(USE_PDL)
    req = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    seq_len = tl.load(seq_lens_ptr + req)
    if PARTITION_BLOCKS > 0:  # fixed partitions: a long context takes more splits, a short one leaves some empty
        blocks_per_split = PARTITION_BLOCKS
    else:  # each context in ``num_splits`` equal parts
        blocks_per_split = tl.cdiv(tl.cdiv(seq_len, BLOCK_SIZE), num_splits)
    start = split * blocks_per_split * BLOCK_SIZE
    end = tl.minimum(start + blocks_per_split * BLOCK_SIZE, seq_len)

    offs_g = tl.arange(0, GROUP_PAD)
    offs_d = tl.arange(0, HEAD_SIZE)
    offs_n = tl.arange(0, BLOCK_N)
    heads = kv_head * GROUP + offs_g
    head_mask = offs_g < GROUP
    q = tl.load(q_ptr + req * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
                mask=head_mask[:, None], other=0.0)
    q = to_dot_dtype(q, DOT_DTYPE)

    k_base = k_ptr + kv_head.to(tl.int64) * stride_kh
    v_base = v_ptr + kv_head.to(tl.int64) * stride_vh
    table = block_tables_ptr + req.to(tl.int64) * stride_bt

    m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, HEAD_SIZE], tl.float32)
    for tile_start in range(start, end, BLOCK_N):
        pos = tile_start + offs_n
        key_mask = pos < end
        block_ids = tl.load(table + pos // BLOCK_SIZE, mask=key_mask, other=0).to(tl.int64)
        slot = pos % BLOCK_SIZE
        k = tl.load(k_base + block_ids[:, None] * stride_kb + slot[:, None] * stride_kt + offs_d[None, :],
                    mask=key_mask[:, None], other=0.0).to(DOT_DTYPE)
        scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
        scores = tl.where(key_mask[None, :], scores, float("-inf"))

        # The first tile of a non-empty split always holds a valid key, so m_new is finite from then on.
        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(scores - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(v_base + block_ids[:, None] * stride_vb + slot[:, None] * stride_vt + offs_d[None, :],
                    mask=key_mask[:, None], other=0.0).to(DOT_DTYPE)
        acc = acc * alpha[:, None] + tl.dot(p.to(DOT_DTYPE), v, input_precision=DOT_PRECISION)
        m_i = m_new

    # An empty split (sequence shorter than the splits, or a padding row) yields zeros and weight 0.
    has_keys = l_i > 0.0
    acc = acc / tl.where(has_keys, l_i, 1.0)[:, None]
    out_offs = req * stride_ob + heads[:, None] * stride_oh + offs_d[None, :]
    if DIRECT:
        tl.store(out_ptr + out_offs, acc, mask=head_mask[:, None])
    else:
        tl.store(out_ptr + out_offs + split * stride_os, acc, mask=head_mask[:, None])
        lse = tl.where(has_keys, m_i + tl.log2(tl.where(has_keys, l_i, 1.0)), float("-inf"))
        tl.store(lse_ptr + req * stride_lb + heads * stride_lh + split, lse, mask=head_mask)


@triton.jit
def _decode_merge_kernel(
    partial_ptr, lse_ptr, out_ptr, num_splits,
    stride_pb, stride_ph, stride_ps,
    stride_lb, stride_lh,
    stride_ob, stride_oh,
    SPLITS_PAD: tl.constexpr, HEAD_SIZE: tl.constexpr, USE_PDL: tl.constexpr,
):
    wait_for_previous(USE_PDL)
    req = tl.program_id(0)
    head = tl.program_id(1)
    offs_s = tl.arange(0, SPLITS_PAD)
    offs_d = tl.arange(0, HEAD_SIZE)
    split_mask = offs_s < num_splits

    lse = tl.load(lse_ptr + req * stride_lb + head * stride_lh + offs_s, mask=split_mask, other=float("-inf"))
    lse_max = tl.max(lse, axis=0)
    # All splits empty (seq_len 0): every weight is 0 and the output is 0, not NaN.
    lse_max = tl.where(lse_max == float("-inf"), 0.0, lse_max)
    weights = tl.exp2(lse - lse_max)
    total = tl.sum(weights, axis=0)
    weights = weights / tl.where(total > 0.0, total, 1.0)

    partial = tl.load(partial_ptr + req * stride_pb + head * stride_ph + offs_s[:, None] * stride_ps
                      + offs_d[None, :], mask=split_mask[:, None], other=0.0)
    out = tl.sum(partial * weights[:, None], axis=0)
    tl.store(out_ptr + req * stride_ob + head * stride_oh + offs_d, out)


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    num_splits: int,
    out: torch.Tensor | None = None,
    workspace: DecodeWorkspace | None = None,
    block_n: int | None = None,
    num_warps: int = 4,
    num_stages: int = 3,
    launch_cache: dict | None = None,
    partition_size: int | None = None,
) -> torch.Tensor:
    """Attention of each request's single query token over its paged K/V; returns ``out`` ``[B, H, D]``.

    :param num_splits: sequence splits per request (a host int, so the launch is graph-capturable); see
        :func:`choose_num_splits`.
    :param workspace: scratch for ``num_splits > 1``; allocated here when omitted.
    :param block_n, num_warps, num_stages: stage 1's tile of keys (None: by the split count) and launch shape
        (a sweep, docs/benchmarks.md times the alternatives).
    :param launch_cache: a dict kept for one step's layers, to launch them without Triton's dispatch
        (:func:`rtx_kernels.launch.launch`).
    :param partition_size: split every context into partitions of this many tokens (a multiple of the cache's block
        size) instead of ``num_splits`` equal parts, so that long contexts get more programs than short ones;
        ``num_splits`` must then cover the longest context (``cdiv(max_len, partition_size)``): splits past a
        context's end are empty. The engine does not use it: on an H100 it was slower than equal splits at W2's
        contexts (docs/benchmarks.md, Decisions); benchmarks/decode_attention_sweep.py times it.
    """
    batch, num_heads, head_size = q.shape
    num_kv_heads, _, block_size, _ = k_cache.shape
    if num_heads % num_kv_heads:
        raise ValueError(f"{num_heads} query heads are not a multiple of {num_kv_heads} kv heads")
    if head_size < 16 or head_size & (head_size - 1):
        raise ValueError(f"head size {head_size} must be a power of two >= 16")
    if num_splits < 1:
        raise ValueError(f"num_splits must be >= 1, got {num_splits}")
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache), ("block_tables", block_tables),
                    ("out", out)):
        if t is not None and t.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in its last dimension")
    partition_blocks = 0
    if partition_size is not None:
        if partition_size < block_size or partition_size % block_size:
            raise ValueError(f"partition_size {partition_size} must be a multiple of the block size {block_size}")
        partition_blocks = partition_size // block_size
    if out is None:
        out = torch.empty_like(q)
    group = num_heads // num_kv_heads
    direct = num_splits == 1
    if block_n is None:
        block_n = unsplit_block_n(head_size, k_cache.dtype.itemsize) if direct else _BLOCK_N
    if direct:
        partial, lse = out, out  # lse is unused on the direct path
        partial_strides = (out.stride(0), out.stride(1), 0)
        lse_strides = (0, 0)
    else:
        if workspace is None:
            workspace = DecodeWorkspace.allocate(batch, num_heads, num_splits, head_size, q.device)
        partial = workspace.partial_out[:batch, :, :num_splits]
        lse = workspace.partial_lse[:batch, :, :num_splits]
        if partial.shape != (batch, num_heads, num_splits, head_size) or lse.stride(-1) != 1:
            raise ValueError(f"workspace {tuple(workspace.partial_out.shape)} is too small or not contiguous")
        partial_strides = partial.stride()[:3]
        lse_strides = lse.stride()[:2]

    use_pdl = pdl_enabled(q.device)
    options = {"num_warps": num_warps, "num_stages": num_stages, **launch_options(use_pdl)}
    launch(_decode_split_kernel, (batch, num_kv_heads, num_splits), (
        q, k_cache, v_cache, block_tables, seq_lens, partial, lse,
        scale * _LOG2E, num_splits,
        q.stride(0), q.stride(1),
        *k_cache.stride()[:3],
        *v_cache.stride()[:3],
        block_tables.stride(0),
        *partial_strides,
        *lse_strides,
    ), {
        "GROUP": group, "GROUP_PAD": max(16, triton.next_power_of_2(group)), "HEAD_SIZE": head_size,
        "BLOCK_SIZE": block_size, "BLOCK_N": block_n, "DIRECT": direct,
        # fp32 inputs would otherwise run in TF32 on the GPU and miss fp32 accuracy.
        "DOT_PRECISION": "ieee" if q.dtype == torch.float32 else "tf32",
        "DOT_DTYPE": dot_dtype(q.dtype, k_cache.dtype), "USE_PDL": use_pdl, "PARTITION_BLOCKS": partition_blocks,
    }, options, launch_cache)
    if not direct:
        launch(_decode_merge_kernel, (batch, num_heads), (
            partial, lse, out, num_splits,
            *partial_strides,
            *lse_strides,
            out.stride(0), out.stride(1),
        ), {"SPLITS_PAD": triton.next_power_of_2(num_splits), "HEAD_SIZE": head_size, "USE_PDL": use_pdl},
            launch_options(use_pdl), launch_cache)
    return out
