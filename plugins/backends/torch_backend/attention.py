"""Attention over the paged KV cache in plain torch (the CPU path and the reference for the Triton kernels).

The step's tokens arrive flat: decodes first (one token each), then prefill chunks. New K/V entries are written to
their slots before attention reads, so a chunk sees its own tokens and every cached prefix block.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from rtxcore.contracts.backend import ForwardBatch


@dataclass(slots=True)
class PrefillSlice:
    # Rows of this request's new tokens in the flat batch.
    start: int
    end: int
    # Context length once the chunk is in (cached prefix + chunk).
    seq_len: int
    # Block ids covering the context.
    block_ids: torch.Tensor

    @property
    def has_prefix(self) -> bool:
        return self.seq_len > self.end - self.start


@dataclass(slots=True)
class DecodeGroup:
    # Rows [start, end) of the flat batch: one query token each.
    start: int
    end: int
    # Block tables trimmed to the group's longest context, and which key positions are real.
    block_tables: torch.Tensor
    key_mask: torch.Tensor


# Decodes arrive sorted by context length; attending in groups of similar length gathers little padding.
DECODE_GROUP_SIZE = 16


@dataclass(slots=True)
class FusedDecode:
    # A kernel that walks block tables itself: f(q, k_cache, v_cache, block_tables, seq_lens, scale).
    kernel: Callable[..., torch.Tensor]
    block_tables: torch.Tensor
    seq_lens: torch.Tensor


@dataclass(slots=True)
class AttentionMetadata:
    # None when the step must not write the cache (embeddings).
    slot_mapping: torch.Tensor | None
    num_decodes: int
    decode_groups: list[DecodeGroup]
    prefills: list[PrefillSlice]
    # Causal masks for chunks that attend to a cached prefix, keyed by (chunk length, seq_len).
    prefix_masks: dict[tuple[int, int], torch.Tensor]
    # Set when a fused decode kernel replaces the grouped torch path.
    fused_decode: FusedDecode | None = None

    @classmethod
    def from_batch(cls, batch: ForwardBatch, device: torch.device,
                   decode_kernel: Callable[..., torch.Tensor] | None = None) -> "AttentionMetadata":
        bs = batch.block_size
        nd = batch.num_decodes
        groups = []
        fused = None
        if nd and decode_kernel is not None:
            num_blocks = -(-max(batch.seq_lens[:nd]) // bs)
            fused = FusedDecode(decode_kernel, batch.block_tables[:nd, :num_blocks].to(device, torch.long),
                                torch.tensor(batch.seq_lens[:nd], dtype=torch.long, device=device))
        for start in range(0, nd if fused is None else 0, DECODE_GROUP_SIZE):
            end = min(start + DECODE_GROUP_SIZE, nd)
            num_blocks = -(-max(batch.seq_lens[start:end]) // bs)
            tables = batch.block_tables[start:end, :num_blocks].to(device=device, dtype=torch.long)
            lens = torch.tensor(batch.seq_lens[start:end], device=device)
            mask = torch.arange(num_blocks * bs, device=device)[None, :] < lens[:, None]
            groups.append(DecodeGroup(start, end, tables, mask))
        prefills, masks = [], {}
        qsl = batch.query_start_loc
        for i in range(nd, batch.num_reqs):
            seq_len = batch.seq_lens[i]
            blocks = batch.block_tables[i, : -(-seq_len // bs)].to(device=device, dtype=torch.long)
            p = PrefillSlice(qsl[i], qsl[i + 1], seq_len, blocks)
            prefills.append(p)
            n = p.end - p.start
            if p.has_prefix and (n, seq_len) not in masks:
                # Query i (absolute position seq_len - n + i) may see keys at positions <= its own.
                q_pos = torch.arange(seq_len - n, seq_len, device=device)
                masks[(n, seq_len)] = torch.arange(seq_len, device=device)[None, :] <= q_pos[:, None]
        slots = batch.slot_mapping.to(device) if batch.write_kv else None
        return cls(slots, nd, groups, prefills, masks, fused)


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    rotary: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]],
    kv_cache: tuple[torch.Tensor, torch.Tensor],
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """q: [tokens, heads, d]; k, v: [tokens, kv_heads, d] before rotary embedding; caches: [kv_heads, num_blocks,
    block_size, d].

    The cache is head-major so that gathering a request's blocks along dim 1 gives [kv_heads, context, d] directly
    in the layout the matmuls want, with no second copy. Returns [tokens, heads, d].
    """
    q, k = rotary(positions, q, k)
    k_cache, v_cache = kv_cache
    kv_heads, num_blocks, block_size, d = k_cache.shape
    if meta.slot_mapping is not None:
        _store(k_cache, meta.slot_mapping, k)
        _store(v_cache, meta.slot_mapping, v)
    out = torch.empty_like(q)
    if meta.fused_decode is not None:
        f = meta.fused_decode
        out[: meta.num_decodes] = f.kernel(q[: meta.num_decodes].contiguous(), k_cache, v_cache, f.block_tables,
                                           f.seq_lens, scale)
    for g in meta.decode_groups:
        out[g.start:g.end] = _decode(q[g.start:g.end], k_cache, v_cache, g.block_tables, g.key_mask, scale)
    for p in meta.prefills:
        qs = q[p.start:p.end].transpose(0, 1)
        if p.has_prefix:
            keys = _gather(k_cache, p.block_ids, q.dtype).flatten(1, 2)[:, : p.seq_len]
            values = _gather(v_cache, p.block_ids, q.dtype).flatten(1, 2)[:, : p.seq_len]
            mask = meta.prefix_masks[(p.end - p.start, p.seq_len)]
            o = _sdpa(qs, keys, values, scale, mask=mask)
        else:
            # The chunk is the whole context: attend to its own K/V directly, no gather needed. With an fp8 cache, as
            # stored: every query then sees the same keys the Triton kernels, which read them from the cache, see.
            keys, values = (_as_stored(x[p.start:p.end], k_cache.dtype).transpose(0, 1) for x in (k, v))
            o = _sdpa(qs, keys, values, scale, causal=True)
        out[p.start:p.end] = o.transpose(0, 1)
    return out


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, *,
          mask: torch.Tensor | None = None, causal: bool = False) -> torch.Tensor:
    """Head-first tensors: q [heads, n, d], k/v [kv_heads, L, d]."""
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, scale=scale, enable_gqa=True)


def _decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
            key_mask: torch.Tensor, scale: float) -> torch.Tensor:
    """One query per request against its paged context: q [B, heads, d] -> [B, heads, d]."""
    b, heads, d = q.shape
    kv_heads = k_cache.shape[0]
    group = heads // kv_heads
    flat = block_tables.reshape(-1)
    keys = _gather(k_cache, flat, q.dtype).view(kv_heads, b, -1, d)  # [kv_heads, B, L, d]
    values = _gather(v_cache, flat, q.dtype).view(kv_heads, b, -1, d)
    qg = q.view(b, kv_heads, group, d).transpose(0, 1)  # [kv_heads, B, group, d]
    scores = torch.matmul(qg, keys.transpose(-1, -2)) * scale  # [kv_heads, B, group, L]
    scores.masked_fill_(~key_mask[None, :, None, :], float("-inf"))
    probs = torch.softmax(scores.float(), dim=-1).to(q.dtype)
    return torch.matmul(probs, values).permute(1, 0, 2, 3).reshape(b, heads, d)


# An fp8 cache (BackendOptions.kv_cache_dtype) holds e4m3 values, unscaled. torch's CPU index_copy_ and index_select
# have no fp8 kernels, so its bytes are moved as uint8.


def _store(cache: torch.Tensor, slots: torch.Tensor, x: torch.Tensor) -> None:
    """Write ``x`` [tokens, kv_heads, d] into ``cache`` [kv_heads, blocks, block_size, d] at flat ``slots``."""
    kv_heads, d = cache.shape[0], cache.shape[3]
    if cache.dtype == x.dtype:
        cache.view(kv_heads, -1, d).index_copy_(1, slots, x.transpose(0, 1))
        return
    stored = _narrow(x.transpose(0, 1), cache.dtype)
    cache.view(torch.uint8).view(kv_heads, -1, d).index_copy_(1, slots, stored.view(torch.uint8))


def _narrow(x: torch.Tensor, cache_dtype: torch.dtype) -> torch.Tensor:
    # Saturated as the Triton kernel stores it, rather than left to the conversion's handling of larger values.
    largest = torch.finfo(cache_dtype).max
    return x.float().clamp(-largest, largest).to(cache_dtype)


def _as_stored(x: torch.Tensor, cache_dtype: torch.dtype) -> torch.Tensor:
    """``x`` as a cache of ``cache_dtype`` gives it back."""
    return x if cache_dtype == x.dtype else _narrow(x, cache_dtype).to(x.dtype)


def _gather(cache: torch.Tensor, block_ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Blocks ``block_ids`` of ``cache``, ``[kv_heads, n, block_size, d]``, in the compute ``dtype``."""
    if cache.dtype == dtype:
        return cache.index_select(1, block_ids)
    return cache.view(torch.uint8).index_select(1, block_ids).view(cache.dtype).to(dtype)
