"""The torch backend's decoder, wrapped so that one forward pass is a self-contained graph over a flat KV cache.

Inputs (B requests, T new tokens each at most, P past tokens each at most, S cache slots; padding is masked out):

    input_ids       [B, T] int64
    positions       [B, T] int64      absolute position of each new token (padding: 0)
    attention_bias  [B, T, P + T]     0 where a query may attend, a large negative number where not
    logits_rows     [R] int64         rows of the flattened [B * T] tokens whose logits are wanted
    past_slots      [B, P] int64      cache slot of each past token (padding: any slot, it is masked)
    key_cache       [L * S, KVH, D]   the engine's paged cache: layer l's slot s (block_id * block_size + offset) is
    value_cache     [L * S, KVH, D]   row l * S + s; K after rotary embedding; passed by reference, read only

Outputs: ``logits`` [R, vocab], ``present_keys`` / ``present_values`` [L, B, T, KVH, D] (the new tokens' K/V; the
backend writes them into their slots). The graph gathers each request's past from the cache itself, so the host
copies no past K/V: the runtime reads the cache buffer in place. Grouped-query attention runs per KV head on groups
of query heads (no K/V is repeated); rotary embedding is the model's own, so cache entries match the torch backend's.
The layers share one flat cache input, rather than one per layer or a [L, S, ...] tensor indexed by layer, because
indexing a graph input by layer makes the runtime copy that layer's whole cache on every call.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from rtx_plugins.backends.torch_backend.model import LlamaForCausalLM

INPUT_NAMES = ("input_ids", "positions", "attention_bias", "logits_rows", "past_slots", "key_cache", "value_cache")
OUTPUT_NAMES = ("logits", "present_keys", "present_values")
# Masked scores: finite, so a padding row with every key masked softmaxes to a uniform (ignored) row, not NaN.
MASKED = -1e9


@dataclass(slots=True)
class DenseAttentionMeta:
    batch: torch.Tensor | int
    tokens: torch.Tensor | int
    attention_bias: torch.Tensor


@dataclass(slots=True)
class LayerKV:
    past_keys: torch.Tensor
    past_values: torch.Tensor
    # Where the layer leaves its new K/V; the wrapper stacks them into the graph's outputs.
    present: list[tuple[torch.Tensor, torch.Tensor]]


def dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor, rotary,
                    kv: LayerKV, meta: DenseAttentionMeta, scale: float) -> torch.Tensor:
    """The torch model's attention hook over dense past K/V: q [B*T, H, D], k/v [B*T, KVH, D] -> [B*T, H, D]."""
    q, k = rotary(positions, q, k)
    b, t = meta.batch, meta.tokens
    kv_heads, d = k.shape[1], k.shape[2]
    group = q.shape[1] // kv_heads
    new_k, new_v = k.reshape(b, t, kv_heads, d), v.reshape(b, t, kv_heads, d)
    kv.present.append((new_k, new_v))
    keys = torch.cat([kv.past_keys, new_k], dim=1).transpose(1, 2)  # [B, KVH, P+T, D]
    values = torch.cat([kv.past_values, new_v], dim=1).transpose(1, 2)
    # Query head h reads KV head h // group (the Hugging Face layout): fold the group into the query rows.
    qg = q.reshape(b, t, kv_heads, group, d).permute(0, 2, 3, 1, 4).reshape(b, kv_heads, group * t, d)
    scores = torch.matmul(qg, keys.transpose(-1, -2)) * scale
    scores = scores.reshape(b, kv_heads, group, t, -1) + meta.attention_bias[:, None, None]
    probs = torch.softmax(scores.float(), dim=-1).to(q.dtype).reshape(b, kv_heads, group * t, -1)
    out = torch.matmul(probs, values)  # [B, KVH, G*T, D]
    return out.reshape(b, kv_heads, group, t, d).permute(0, 3, 1, 2, 4).reshape(-1, kv_heads * group, d)


class DenseKVGraph(nn.Module):
    """What gets exported: the decoder (weights included) with the dense-cache interface above."""

    def __init__(self, model: LlamaForCausalLM):
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attention_bias: torch.Tensor,
                logits_rows: torch.Tensor, past_slots: torch.Tensor, key_cache: torch.Tensor,
                value_cache: torch.Tensor):
        b, t = input_ids.shape[0], input_ids.shape[1]
        num_layers = self.model.config.num_layers
        past_shape = (b, past_slots.shape[1], key_cache.shape[1], key_cache.shape[2])
        slots_per_layer = key_cache.shape[0] // num_layers
        flat_slots = past_slots.reshape(-1)
        present: list[tuple[torch.Tensor, torch.Tensor]] = []
        layers = []
        for i in range(num_layers):
            rows = flat_slots + i * slots_per_layer
            layers.append(LayerKV(key_cache.index_select(0, rows).reshape(past_shape),
                                  value_cache.index_select(0, rows).reshape(past_shape), present))
        meta = DenseAttentionMeta(b, t, attention_bias)
        hidden = self.model.hidden_states(input_ids.reshape(-1), positions.reshape(-1), layers, meta, dense_attention)
        logits = self.model.compute_logits(hidden.index_select(0, logits_rows)).float()
        keys = torch.stack([k for k, _ in present])
        values = torch.stack([v for _, v in present])
        return logits, keys, values
