"""Attention over the paged KV cache in plain torch (the CPU path and the reference for the Triton kernels).

The step's tokens arrive flat: decodes first (one token each), then prefill chunks. New K/V entries are written to
their slots before attention reads, so a chunk sees its own tokens and every cached prefix block.
"""

from __future__ import annotations

from dataclasses import dataclass

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
class AttentionMetadata:
    slot_mapping: torch.Tensor
    num_decodes: int
    # Decode rows: block tables trimmed to the longest context, and a mask of valid key positions.
    decode_block_tables: torch.Tensor | None
    decode_key_mask: torch.Tensor | None
    prefills: list[PrefillSlice]
    # Causal masks for chunks that attend to a cached prefix, keyed by (chunk length, seq_len).
    prefix_masks: dict[tuple[int, int], torch.Tensor]

    @classmethod
    def from_batch(cls, batch: ForwardBatch, device: torch.device) -> "AttentionMetadata":
        bs = batch.block_size
        nd = batch.num_decodes
        decode_tables = decode_mask = None
        if nd:
            max_len = max(batch.seq_lens[:nd])
            num_blocks = -(-max_len // bs)
            decode_tables = batch.block_tables[:nd, :num_blocks].to(device=device, dtype=torch.long)
            lens = torch.tensor(batch.seq_lens[:nd], device=device)
            decode_mask = torch.arange(num_blocks * bs, device=device)[None, :] < lens[:, None]
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
        return cls(batch.slot_mapping.to(device), nd, decode_tables, decode_mask, prefills, masks)


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """q: [tokens, heads, d]; k, v: [tokens, kv_heads, d]; caches: [num_blocks, block_size, kv_heads, d].

    Returns [tokens, heads, d].
    """
    num_blocks, block_size, kv_heads, d = k_cache.shape
    k_cache.view(-1, kv_heads, d).index_copy_(0, meta.slot_mapping, k)
    v_cache.view(-1, kv_heads, d).index_copy_(0, meta.slot_mapping, v)
    out = torch.empty_like(q)
    nd = meta.num_decodes
    if nd:
        out[:nd] = _decode(q[:nd], k_cache, v_cache, meta.decode_block_tables, meta.decode_key_mask, scale)
    for p in meta.prefills:
        qs = q[p.start:p.end]
        if p.has_prefix:
            keys = k_cache[p.block_ids].flatten(0, 1)[: p.seq_len]
            values = v_cache[p.block_ids].flatten(0, 1)[: p.seq_len]
            mask = meta.prefix_masks[(p.end - p.start, p.seq_len)]
            out[p.start:p.end] = _sdpa(qs, keys, values, scale, mask=mask)
        else:
            # The chunk is the whole context: attend to the fresh K/V directly, no gather needed.
            out[p.start:p.end] = _sdpa(qs, k[p.start:p.end], v[p.start:p.end], scale, causal=True)
    return out


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, *,
          mask: torch.Tensor | None = None, causal: bool = False) -> torch.Tensor:
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
        attn_mask=mask, is_causal=causal, scale=scale, enable_gqa=True,
    )
    return out.transpose(0, 1)


def _decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
            key_mask: torch.Tensor, scale: float) -> torch.Tensor:
    """One query per request against its paged context: q [B, heads, d] -> [B, heads, d]."""
    b, heads, d = q.shape
    kv_heads = k_cache.shape[2]
    group = heads // kv_heads
    keys = k_cache[block_tables].flatten(1, 2)  # [B, L, kv_heads, d]
    values = v_cache[block_tables].flatten(1, 2)
    qg = q.view(b, kv_heads, group, d)
    scores = torch.einsum("bkgd,blkd->bkgl", qg, keys) * scale
    scores.masked_fill_(~key_mask[:, None, None, :], float("-inf"))
    probs = torch.softmax(scores.float(), dim=-1).to(q.dtype)
    return torch.einsum("bkgl,blkd->bkgd", probs, values).reshape(b, heads, d)
