"""Causal varlen (chunked) prefill attention over the paged KV cache, flash-attention style, in Triton.

Layouts:
- ``q``: ``[T, H, D]``, the flat tokens of R requests; request r owns rows
  ``query_start_loc[r]:query_start_loc[r + 1]``.
- ``k_cache`` / ``v_cache``: head-major paged ``[KVH, num_blocks, block_size, D]`` (the engine's layout). The
  chunk's own K/V are already written there, so every key of request r, cached prefix and chunk alike, is read
  through its row of ``block_tables`` (int32 ``[R, max_blocks]``). They hold ``q``'s dtype or fp8 (e4m3, unscaled),
  widened as tiles load (see ``fp8_cache``).
- ``seq_lens``: int32 ``[R]``, the context length including this chunk. Query i of a chunk of ``qlen`` tokens sits
  at position ``seq_len - qlen + i`` and attends to every key at or before it.

One program handles ``BLOCK_Q`` queries of one request for all ``group`` query heads of one kv head: its rows are
the (query, head) pairs, so each K/V tile, gathered through the block table, is loaded once for the whole group.
Softmax is online over key tiles with fp32 accumulation, in base 2. The grid is
``(R, KVH, cdiv(max_query_len, BLOCK_Q))``; programs past their request's chunk exit at once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from rtx_kernels.fp8_cache import dot_dtype, to_dot_dtype
from rtx_kernels.launch import launch

_LOG2E = 1.4426950408889634
# Rows (query x head pairs) and keys per tile, and the launch's warps and pipeline stages: the fastest of a sweep on
# the H200 at llama-1b's heads for a long prompt, a chunk after a long context and many short prompts alike
# (benchmarks/prefill_attention_sweep.py; docs/benchmarks.md).
_BLOCK_ROWS = 64
_BLOCK_N = 64
_NUM_WARPS = 4
_NUM_STAGES = 2


@triton.jit
def _attend_tile(q, q_pos, m_i, l_i, acc, tile_start, end, table, k_base, v_base, qk_scale,
                 stride_kb, stride_kt, stride_vb, stride_vt,
                 HEAD_SIZE: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
                 DOT_PRECISION: tl.constexpr, DOT_DTYPE: tl.constexpr, MASKED: tl.constexpr):
    """One key tile of the online softmax; ``MASKED`` tiles may hold keys past ``end`` or after some rows' queries."""
    offs_d = tl.arange(0, HEAD_SIZE)
    pos = tile_start + tl.arange(0, BLOCK_N)
    slot = pos % BLOCK_SIZE
    if MASKED:
        key_mask = pos < end
        block_ids = tl.load(table + pos // BLOCK_SIZE, mask=key_mask, other=0).to(tl.int64)
        k = tl.load(k_base + block_ids[:, None] * stride_kb + slot[:, None] * stride_kt + offs_d[None, :],
                    mask=key_mask[:, None], other=0.0).to(DOT_DTYPE)
    else:
        block_ids = tl.load(table + pos // BLOCK_SIZE).to(tl.int64)
        k = tl.load(k_base + block_ids[:, None] * stride_kb + slot[:, None] * stride_kt + offs_d[None, :]).to(DOT_DTYPE)
    scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
    if MASKED:
        # Every row sees key 0 (q_pos >= 0), so after the first tile each row's maximum is finite.
        visible = key_mask[None, :] & (pos[None, :] <= q_pos[:, None])
        scores = tl.where(visible, scores, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(scores, axis=1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(scores - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    if MASKED:
        v = tl.load(v_base + block_ids[:, None] * stride_vb + slot[:, None] * stride_vt + offs_d[None, :],
                    mask=key_mask[:, None], other=0.0).to(DOT_DTYPE)
    else:
        v = tl.load(v_base + block_ids[:, None] * stride_vb + slot[:, None] * stride_vt + offs_d[None, :]).to(DOT_DTYPE)
    acc = acc * alpha[:, None] + tl.dot(p.to(DOT_DTYPE), v, input_precision=DOT_PRECISION)
    return m_new, l_i, acc


@triton.jit
def _prefill_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, query_start_loc_ptr, seq_lens_ptr, block_tables_ptr,
    qk_scale,
    stride_qt, stride_qh,
    stride_kh, stride_kb, stride_kt,
    stride_vh, stride_vb, stride_vt,
    stride_ot, stride_oh,
    stride_bt,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, BLOCK_Q: tl.constexpr, HEAD_SIZE: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr, DOT_DTYPE: tl.constexpr,
):
    req = tl.program_id(0)
    kv_head = tl.program_id(1)
    q_block = tl.program_id(2)

    q_start = tl.load(query_start_loc_ptr + req)
    q_len = tl.load(query_start_loc_ptr + req + 1) - q_start
    if q_block * BLOCK_Q >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + req)
    context_len = seq_len - q_len

    rows = tl.arange(0, BLOCK_Q * GROUP_PAD)
    q_idx = q_block * BLOCK_Q + rows // GROUP_PAD
    heads = kv_head * GROUP + rows % GROUP_PAD
    row_mask = (q_idx < q_len) & (rows % GROUP_PAD < GROUP)
    offs_d = tl.arange(0, HEAD_SIZE)
    q_offs = (q_start + q_idx)[:, None] * stride_qt + heads[:, None] * stride_qh + offs_d[None, :]
    q = to_dot_dtype(tl.load(q_ptr + q_offs, mask=row_mask[:, None], other=0.0), DOT_DTYPE)
    q_pos = context_len + q_idx

    k_base = k_ptr + kv_head.to(tl.int64) * stride_kh
    v_base = v_ptr + kv_head.to(tl.int64) * stride_vh
    table = block_tables_ptr + req.to(tl.int64) * stride_bt
    # Causality bounds the keys this block of queries can see.
    end = tl.minimum(seq_len, context_len + (q_block + 1) * BLOCK_Q)
    # Tiles wholly before the block's first query are visible to every row: no mask there. At a long prompt's
    # last query blocks that is nearly every tile.
    unmasked_end = (context_len + q_block * BLOCK_Q) // BLOCK_N * BLOCK_N

    m_i = tl.full([BLOCK_Q * GROUP_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_Q * GROUP_PAD], tl.float32)
    acc = tl.zeros([BLOCK_Q * GROUP_PAD, HEAD_SIZE], tl.float32)
    for tile_start in range(0, unmasked_end, BLOCK_N):
        m_i, l_i, acc = _attend_tile(q, q_pos, m_i, l_i, acc, tile_start, end, table, k_base, v_base, qk_scale,
                                     stride_kb, stride_kt, stride_vb, stride_vt,
                                     HEAD_SIZE, BLOCK_SIZE, BLOCK_N, DOT_PRECISION, DOT_DTYPE, False)
    for tile_start in range(unmasked_end, end, BLOCK_N):
        m_i, l_i, acc = _attend_tile(q, q_pos, m_i, l_i, acc, tile_start, end, table, k_base, v_base, qk_scale,
                                     stride_kb, stride_kt, stride_vb, stride_vt,
                                     HEAD_SIZE, BLOCK_SIZE, BLOCK_N, DOT_PRECISION, DOT_DTYPE, True)

    acc = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
    out_offs = (q_start + q_idx)[:, None] * stride_ot + heads[:, None] * stride_oh + offs_d[None, :]
    tl.store(out_ptr + out_offs, acc, mask=row_mask[:, None])


def prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    max_query_len: int,
    out: torch.Tensor | None = None,
    block_rows: int = _BLOCK_ROWS,
    block_n: int = _BLOCK_N,
    num_warps: int = _NUM_WARPS,
    num_stages: int = _NUM_STAGES,
    launch_cache: dict | None = None,
) -> torch.Tensor:
    """Causal attention of each request's chunk over its whole paged context; returns ``out`` ``[T, H, D]``.

    :param max_query_len: the longest chunk (a host int; it sizes the grid).
    :param block_rows, block_n, num_warps, num_stages: the launch shape (a sweep, docs/benchmarks.md times the
        alternatives).
    :param launch_cache: a dict kept for one step's layers, to launch them without Triton's dispatch
        (:func:`rtx_kernels.launch.launch`).
    """
    num_tokens, num_heads, head_size = q.shape
    num_kv_heads, _, block_size, _ = k_cache.shape
    if num_heads % num_kv_heads:
        raise ValueError(f"{num_heads} query heads are not a multiple of {num_kv_heads} kv heads")
    if head_size < 16 or head_size & (head_size - 1):
        raise ValueError(f"head size {head_size} must be a power of two >= 16")
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache), ("block_tables", block_tables),
                    ("out", out)):
        if t is not None and t.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in its last dimension")
    if out is None:
        out = torch.empty_like(q)
    num_reqs = seq_lens.shape[0]
    if num_tokens == 0 or num_reqs == 0 or max_query_len == 0:
        return out
    group = num_heads // num_kv_heads
    group_pad = triton.next_power_of_2(group)
    block_q = max(1, block_rows // group_pad)
    grid = (num_reqs, num_kv_heads, triton.cdiv(max_query_len, block_q))
    launch(_prefill_kernel, grid, (
        q, k_cache, v_cache, out, query_start_loc, seq_lens, block_tables,
        scale * _LOG2E,
        q.stride(0), q.stride(1),
        *k_cache.stride()[:3],
        *v_cache.stride()[:3],
        out.stride(0), out.stride(1),
        block_tables.stride(0),
    ), {
        "GROUP": group, "GROUP_PAD": group_pad, "BLOCK_Q": block_q, "HEAD_SIZE": head_size,
        "BLOCK_SIZE": block_size, "BLOCK_N": block_n,
        "DOT_PRECISION": "ieee" if q.dtype == torch.float32 else "tf32",
        "DOT_DTYPE": dot_dtype(q.dtype, k_cache.dtype),
    }, {"num_warps": num_warps, "num_stages": num_stages}, launch_cache)
    return out
