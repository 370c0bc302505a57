"""Attention over the paged KV cache on CUDA with the Triton kernels of ``rtx_kernels``.

The step's tokens arrive flat, decodes first. One kernel applies rotary embedding and stores the new K/V entries
in their slots; then one launch attends every
decode row (split along the sequence when the batch is small) and one launch attends every prefill chunk, each
chunk reading its cached prefix through the block table. All metadata lives on the device, so the same code runs
eagerly and inside a captured CUDA graph.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from rtx_kernels.decode_attention import DecodeWorkspace, choose_num_splits, decode_attention
from rtx_kernels.prefill_attention import prefill_attention
from rtx_kernels.rotary import apply_rotary
from rtx_plugins.backends.torch_backend.layers import RotaryEmbedding
from rtxcore import envs
from rtxcore.contracts.backend import ForwardBatch
from rtxcore.transfer import to_device_async


@functools.cache
def _launch_cache_enabled() -> bool:
    """Whether eager steps launch each layer's attention kernels without Triton's dispatch after the first layer
    (rtx_kernels.launch); RTX_LAUNCH_CACHE=0 sends every launch through Triton (to compare the two).

    Read at the first step and kept: this runs for every step, and the variable is an A/B switch set before start.
    """
    return envs.RTX_LAUNCH_CACHE.get()


@dataclass(slots=True)
class TritonAttentionMetadata:
    slot_mapping: torch.Tensor  # [tokens] int64
    num_decodes: int
    decode_block_tables: torch.Tensor  # [decodes, width] int32
    decode_seq_lens: torch.Tensor  # [decodes] int32
    num_splits: int
    num_prefills: int = 0
    # Offsets of each prefill chunk among the prefill tokens (the first prefill token is row 0), [prefills + 1].
    prefill_query_start_loc: torch.Tensor | None = None
    prefill_seq_lens: torch.Tensor | None = None
    prefill_block_tables: torch.Tensor | None = None
    max_query_len: int = 0
    # Split-K scratch shared by every layer's decode attention in an eager step (None: each call allocates its own,
    # as inside a captured graph, whose pool must own it).
    decode_workspace: DecodeWorkspace | None = None
    # Compiled attention kernels kept for the step's later layers (rtx_kernels.launch); None inside CUDA graphs.
    launch_cache: dict | None = None

    @classmethod
    def from_batch(cls, batch: ForwardBatch, device: torch.device, num_kv_heads: int, num_heads: int = 0,
                   head_size: int = 0) -> "TritonAttentionMetadata":
        """:param num_heads, head_size: when given, the step's split-K scratch is allocated once here."""
        nd = batch.num_decodes
        tables = _to(batch.block_tables, device, torch.int32)
        seq_lens = _to(torch.tensor(batch.seq_lens, dtype=torch.int32), device)
        meta = cls(
            slot_mapping=_to(batch.slot_mapping, device, torch.long),
            num_decodes=nd,
            decode_block_tables=tables[:nd],
            decode_seq_lens=seq_lens[:nd],
            num_splits=choose_num_splits(nd, num_kv_heads, max(batch.seq_lens[:nd])) if nd else 1,
        )
        if device.type == "cuda" and _launch_cache_enabled():
            meta.launch_cache = {}
        if meta.num_splits > 1 and num_heads:
            meta.decode_workspace = DecodeWorkspace.allocate(nd, num_heads, meta.num_splits, head_size, device)
        if batch.num_reqs > nd:
            qsl = batch.query_start_loc
            first = qsl[nd]
            meta.num_prefills = batch.num_reqs - nd
            meta.prefill_query_start_loc = _to(torch.tensor([q - first for q in qsl[nd:]], dtype=torch.int32), device)
            meta.prefill_seq_lens = seq_lens[nd:]
            meta.prefill_block_tables = tables[nd:]
            meta.max_query_len = max(qsl[i + 1] - qsl[i] for i in range(nd, batch.num_reqs))
        return meta


def _to(t: torch.Tensor, device: torch.device, dtype: torch.dtype | None = None) -> torch.Tensor:
    return to_device_async(t if dtype is None else t.to(dtype), device)


def triton_paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    rotary: RotaryEmbedding,
    kv_cache: tuple[torch.Tensor, torch.Tensor],
    meta: TritonAttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """q: [tokens, heads, d]; k, v: [tokens, kv_heads, d] before rotary embedding (views into the packed QKV
    projection); caches: [kv_heads, num_blocks, block_size, d]."""
    rotate_and_store(q, k, v, positions, rotary, kv_cache, meta.slot_mapping)
    return attend(q, kv_cache, meta, scale)


def rotate_and_store(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                     rotary: RotaryEmbedding, kv_cache: tuple[torch.Tensor, torch.Tensor],
                     slot_mapping: torch.Tensor) -> None:
    """Rotate q and k in place and store the new K/V in their slots, in one kernel. Its grid is the token count
    alone, so piecewise CUDA graphs capture it with the projections around it."""
    apply_rotary(q, k, positions, rotary.cos, rotary.sin, v, kv_cache[0], kv_cache[1], slot_mapping)


def attend(q: torch.Tensor, kv_cache: tuple[torch.Tensor, torch.Tensor], meta: TritonAttentionMetadata,
           scale: float, out: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of the step's rotated queries ``q`` [tokens, heads, d] over the cache, whose slots already hold
    this step's K/V; writes ``out`` (allocated when None) and returns it."""
    k_cache, v_cache = kv_cache
    if out is None:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    nd = meta.num_decodes
    if nd:
        decode_attention(q[:nd], k_cache, v_cache, meta.decode_block_tables, meta.decode_seq_lens, scale,
                         meta.num_splits, out=out[:nd], workspace=meta.decode_workspace,
                         launch_cache=meta.launch_cache)
    if meta.num_prefills:
        prefill_attention(q[nd:], k_cache, v_cache, meta.prefill_query_start_loc, meta.prefill_seq_lens,
                          meta.prefill_block_tables, scale, meta.max_query_len, out=out[nd:],
                          launch_cache=meta.launch_cache)
    return out
