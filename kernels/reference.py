"""Plain torch references for the Triton kernels, written to be obviously right rather than fast.

The attention references gather each request's keys and values out of the paged cache into dense tensors and
compute in float32 with an explicit mask; the others transcribe the model's own torch code.
"""

from __future__ import annotations

import torch


def gather_kv(cache: torch.Tensor, block_table: torch.Tensor, seq_len: int) -> torch.Tensor:
    """One request's first ``seq_len`` cache positions, ``[KVH, seq_len, D]``, from ``[KVH, blocks, bs, D]``."""
    block_size = cache.shape[2]
    num_blocks = -(-seq_len // block_size)
    if cache.dtype.itemsize == 1:  # fp8: torch's CPU indexing has no fp8 kernels, so gather the bytes
        blocks = cache.view(torch.uint8)[:, block_table[:num_blocks].long()].view(cache.dtype)
    else:
        blocks = cache[:, block_table[:num_blocks].long()]  # [KVH, n, bs, D]
    return blocks.reshape(cache.shape[0], -1, cache.shape[3])[:, :seq_len]


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, mask: torch.Tensor) -> torch.Tensor:
    """``q`` [Tq, H, D], ``k``/``v`` [KVH, Tk, D], ``mask`` [Tq, Tk] (True = attend); float32 ``[Tq, H, D]``."""
    group = q.shape[1] // k.shape[0]
    k = k.float().repeat_interleave(group, dim=0)  # [H, Tk, D]
    v = v.float().repeat_interleave(group, dim=0)
    scores = torch.einsum("qhd,hkd->hqk", q.float(), k) * scale
    scores = scores.masked_fill(~mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    return torch.einsum("hqk,hkd->qhd", probs, v)


def decode_attention_ref(q, k_cache, v_cache, block_tables, seq_lens, scale) -> torch.Tensor:
    """``q`` [B, H, D]; float32 ``[B, H, D]``, zeros for rows with ``seq_len == 0``."""
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    for b, seq_len in enumerate(seq_lens.tolist()):
        if seq_len == 0:
            continue
        k = gather_kv(k_cache, block_tables[b], seq_len)
        v = gather_kv(v_cache, block_tables[b], seq_len)
        mask = torch.ones(1, seq_len, dtype=torch.bool, device=q.device)
        out[b] = _attend(q[b : b + 1], k, v, scale, mask)[0]
    return out


def prefill_attention_ref(q, k_cache, v_cache, query_start_loc, seq_lens, block_tables, scale) -> torch.Tensor:
    """``q`` [T, H, D] flat tokens; query ``i`` of a chunk of ``qlen`` sits at ``seq_len - qlen + i`` and sees keys at
    positions up to and including its own. Float32 ``[T, H, D]``."""
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    starts = query_start_loc.tolist()
    for r, seq_len in enumerate(seq_lens.tolist()):
        lo, hi = starts[r], starts[r + 1]
        if hi == lo:
            continue
        k = gather_kv(k_cache, block_tables[r], seq_len)
        v = gather_kv(v_cache, block_tables[r], seq_len)
        query_pos = torch.arange(seq_len - (hi - lo), seq_len, device=q.device)
        key_pos = torch.arange(seq_len, device=q.device)
        mask = key_pos[None, :] <= query_pos[:, None]
        out[lo:hi] = _attend(q[lo:hi], k, v, scale, mask)
    return out


def rms_norm_ref(x, weight, eps, residual=None):
    """The model's RMSNorm, verbatim: returns ``(out, residual_out)``."""
    if residual is not None:
        x = x + residual
    residual = x
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype), residual


def apply_rotary_ref(q, k, positions, cos, sin):
    """Half-rotation (HF Llama) rotary embedding computed in float32; returns new ``(q, k)``."""

    c = cos[positions][:, None, :]
    s = sin[positions][:, None, :]

    def rotate(x):
        x1, x2 = x.float().chunk(2, dim=-1)
        return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).to(x.dtype)

    return rotate(q), rotate(k)


def write_kv_ref(k, v, k_cache, v_cache, slot_mapping):
    """Stores ``k`` / ``v`` [T, KVH, D] in place into the ``[KVH, blocks, bs, D]`` caches at flat ``slot_mapping``."""
    kv_heads, _, _, head_size = k_cache.shape
    k_cache.view(kv_heads, -1, head_size).index_copy_(1, slot_mapping, k.transpose(0, 1))
    v_cache.view(kv_heads, -1, head_size).index_copy_(1, slot_mapping, v.transpose(0, 1))


def silu_and_mul_ref(x):
    """``silu(gate) * up`` for ``x = [gate | up]``, computed in float32."""
    gate, up = x.float().chunk(2, dim=-1)
    return (torch.nn.functional.silu(gate) * up).to(x.dtype)


def gemv_ref(x, weight, bias=None):
    """``x @ weight.T + bias`` as an fp32 matmul, rounded once to ``x``'s dtype."""
    y = x.float() @ weight.float().T
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)
