"""A Llama-family decoder (Llama 2/3, SmolLM2, Mistral, Qwen2) over a paged KV cache."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Callable

import torch
from torch import nn

from rtx_plugins.backends.torch_backend.layers import (
    ColumnParallelLinear,
    ParallelContext,
    RMSNorm,
    RotaryEmbedding,
    RowParallelLinear,
    VocabParallelEmbedding,
    check_shape,
)
from rtx_plugins.backends.torch_backend.ops import Ops, torch_ops
from rtx_plugins.backends.torch_backend.quantized import QuantizableLinear
from rtxcore.contracts.quantizer import FP8_ROWS, QuantizedTensor, Quantizer, RoundedRows
from rtxcore.models.config import ModelConfig

AttentionFn = Callable[..., torch.Tensor]


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, ctx: ParallelContext, rotary: RotaryEmbedding, ops: Ops):
        super().__init__()
        d = cfg.head_dim
        self.num_heads = ctx.shard(cfg.num_heads, "attention heads")
        self.num_kv_heads = ctx.shard(cfg.num_kv_heads, "KV heads")
        self.head_dim = d
        self.scale = d ** -0.5
        self.qkv_proj = ColumnParallelLinear(cfg.hidden_size, [cfg.num_heads * d, cfg.num_kv_heads * d,
                                                               cfg.num_kv_heads * d], cfg.attention_bias, ctx, ops)
        self.o_proj = RowParallelLinear(cfg.num_heads * d, cfg.hidden_size, False, ctx, ops)
        self.rotary = rotary

    def forward(self, x: torch.Tensor, positions: torch.Tensor, kv_cache: tuple[torch.Tensor, torch.Tensor],
                meta: object, attention: AttentionFn) -> torch.Tensor:
        q, k, v = self.project_qkv(x)
        # Rotary embedding is the attention function's job: a fused kernel can rotate and store K/V in one pass.
        return self.project_out(attention(q, k, v, positions, self.rotary, kv_cache, meta, self.scale))

    def project_qkv(self, x: torch.Tensor | RoundedRows) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q [n, heads, d], k and v [n, kv_heads, d]: views into one packed projection, before rotary embedding."""
        qkv = self.qkv_proj(x)
        n = qkv.shape[0]
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
        return (q.view(n, self.num_heads, self.head_dim), k.view(n, self.num_kv_heads, self.head_dim),
                v.reshape(n, self.num_kv_heads, self.head_dim))

    def project_out(self, attn_out: torch.Tensor) -> torch.Tensor:
        """[n, heads, d] -> [n, hidden]."""
        return self.o_proj(attn_out.reshape(attn_out.shape[0], self.num_heads * self.head_dim))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, ctx: ParallelContext, ops: Ops):
        super().__init__()
        self.ops = ops
        self.gate_up_proj = ColumnParallelLinear(cfg.hidden_size, [cfg.intermediate_size] * 2, False, ctx, ops)
        self.down_proj = RowParallelLinear(cfg.intermediate_size, cfg.hidden_size, False, ctx, ops)

    def forward(self, x: torch.Tensor | RoundedRows) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        fused = self.ops.silu_and_mul_fp8
        if fused is not None and self.down_proj.rounded_rows(gate_up.shape[0], gate_up.device) is FP8_ROWS:
            # down_proj rounds its input to fp8 per row: the activation's kernel rounds it in the same pass.
            values, scale = fused(gate_up)
            return self.down_proj(RoundedRows(FP8_ROWS, values, scale, gate_up.dtype))
        return self.down_proj(self.ops.silu_and_mul(gate_up))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, ctx: ParallelContext, rotary: RotaryEmbedding, ops: Ops):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ops)
        self.self_attn = Attention(cfg, ctx, rotary, ops)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ops)
        self.mlp = MLP(cfg, ctx, ops)

    def forward(self, x, residual, positions, kv_cache, meta, attention):
        h, residual = self.input_layernorm(x, residual, self.self_attn.qkv_proj)
        h = self.self_attn(h, positions, kv_cache, meta, attention)
        return self.after_attention(h, residual)

    # The layer in two halves around attention, for runners that launch attention on its own (piecewise CUDA
    # graphs): forward == after_attention(o_proj(attention(before_attention(x))))

    def before_attention(self, x: torch.Tensor, residual: torch.Tensor | None):
        """(q, k, v, residual): the input norm and the qkv projection, before rotary embedding."""
        h, residual = self.input_layernorm(x, residual, self.self_attn.qkv_proj)
        return (*self.self_attn.project_qkv(h), residual)

    def after_attention(self, h: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``h``: the attention block's output after o_proj; returns (MLP output, residual)."""
        h, residual = self.post_attention_layernorm(h, residual, self.mlp.gate_up_proj)
        return self.mlp(h), residual


class _OtherStagesLayer(nn.Module):
    """Stands in the layer list for a decoder layer another pipeline stage runs: no weights, never called."""


class LlamaForCausalLM(nn.Module):
    # Checkpoint names (Hugging Face layout) that land in a merged parameter: name -> (merged name, shard index).
    packed_modules = {
        "q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
        "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
    }

    def __init__(self, cfg: ModelConfig, ctx: ParallelContext = ParallelContext(), ops: Ops | None = None):
        super().__init__()
        self.config = cfg
        self.ctx = ctx
        ops = ops or torch_ops()
        rotary = RotaryEmbedding(cfg.head_dim, cfg.max_position, cfg.rope_theta, cfg.rope_scaling, ops)
        # A pipeline stage builds only its own layers; the others are empty placeholders, so that layer i keeps
        # its checkpoint name (model.layers.i) on every stage. The first stage holds the embedding and the LM head
        # (tied or not: the last stage ships the final hidden states back to it), the last one the final norm.
        self.stage_layers = ctx.stage_layers(cfg.num_layers)
        self.layers = nn.ModuleList(DecoderLayer(cfg, ctx, rotary, ops) if i in self.stage_layers
                                    else _OtherStagesLayer() for i in range(cfg.num_layers))
        if ctx.first_stage:
            self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, ctx, ops)
            self.lm_head = self.embed_tokens if cfg.tie_word_embeddings else VocabParallelEmbedding(
                cfg.vocab_size, cfg.hidden_size, ctx, ops)
        if ctx.last_stage:
            self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ops)

    def hidden_states(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list, meta: object,
                      attention: AttentionFn, layers: Sequence[int] | None = None) -> torch.Tensor:
        """The whole model without pipeline stages: token ids in, final (normed) hidden states out.

        :param layers: run only these decoder layers, in order (a self-speculative draft); None runs all.
        """
        x, residual = self.run_layers(self.embed_tokens(input_ids), None, positions, kv_caches, meta, attention,
                                      layers)
        return self.norm(x, residual)[0]

    def stage_forward(self, inputs: torch.Tensor, positions: torch.Tensor, kv_caches: list, meta: object,
                      attention: AttentionFn) -> torch.Tensor:
        """This pipeline stage's share of a step.

        :param inputs: token ids on the first stage; on the others, what the previous stage returned.
        :returns: on the last stage the final (normed) hidden states; on the others the hidden state and the
            residual stacked ``[2, tokens, hidden]``, shipped as they are so that the next stage adds them exactly
            as one process would (summing them here would round once more in bfloat16).
        """
        if self.ctx.first_stage:
            x, residual = self.embed_tokens(inputs), None
        else:
            x, residual = inputs[0], inputs[1]
        x, residual = self.run_layers(x, residual, positions, kv_caches, meta, attention)
        if self.ctx.last_stage:
            return self.norm(x, residual)[0]
        return torch.stack((x, residual))

    def run_layers(self, x: torch.Tensor, residual: torch.Tensor | None, positions: torch.Tensor, kv_caches: list,
                   meta: object, attention: AttentionFn, layers: Sequence[int] | None = None):
        """(hidden, residual) after this stage's decoder layers, or ``layers``; ``kv_caches[i]`` is layer i's."""
        for i in self.stage_layers if layers is None else layers:
            x, residual = self.layers[i](x, residual, positions, kv_caches[i], meta, attention)
        return x, residual

    def linear_layers(self) -> dict[str, QuantizableLinear]:
        """The decoder's linear layers by module name (fused ones once): what quantization applies to."""
        return {name: m for name, m in self.layers.named_modules(prefix="layers") if isinstance(m, QuantizableLinear)}

    def input_modules(self) -> dict[str, QuantizableLinear]:
        """Each of the decoder's linear weights by checkpoint name (``model.layers.0.self_attn.q_proj.weight``),
        with the layer whose input it multiplies (q, k and v share one)."""
        fused = {merged: [] for merged, _ in self.packed_modules.values()}
        for ckpt, (merged, index) in self.packed_modules.items():
            fused[merged].append((index, ckpt))
        out = {}
        for name, module in self.linear_layers().items():
            prefix, _, leaf = name.rpartition(".")
            for _, ckpt in sorted(fused.get(leaf, [(0, leaf)])):
                out[f"model.{prefix}.{ckpt}.weight"] = module
        return out

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head.logits(hidden)

    def weight_slots(self) -> set[str]:
        """Every place a checkpoint tensor must fill: ``param#shard``, a merged layer (q|k|v) having one per part."""
        slots = set()
        for name, _ in self.named_parameters():
            module = self.get_submodule(name.rpartition(".")[0])
            slots.update(f"{name}#{i}" for i in range(len(getattr(module, "shard_sizes", [None]))))
        return slots

    def checkpoint_name(self, slot: str) -> str:
        """The Hugging Face name of the tensor that fills ``slot``."""
        name, _, index = slot.partition("#")
        for ckpt, (merged, i) in self.packed_modules.items():
            if f".{merged}." in name and i == int(index):
                name = name.replace(f".{merged}.", f".{ckpt}.")
                break
        return name if name.startswith("lm_head.") else f"model.{name}"

    def _on_this_stage(self, name: str) -> bool:
        """Whether the checkpoint tensor ``name`` (without "model.") belongs to this rank's pipeline stage."""
        head, _, rest = name.partition(".")
        if head == "layers":
            index = rest.partition(".")[0]
            return not index.isdigit() or int(index) in self.stage_layers
        if head in ("embed_tokens", "lm_head"):
            return self.ctx.first_stage
        if head == "norm":
            return self.ctx.last_stage
        return True

    def load_weight(self, name: str, tensor: torch.Tensor | QuantizedTensor,
                    quantizer: Quantizer | None = None) -> str | None:
        """Copy one checkpoint tensor (Hugging Face name) into its place. :returns: the slot it filled (see
        :meth:`weight_slots`), "" for a tied LM head (the embedding holds it) or a tensor of another pipeline stage,
        None if the name is no parameter.

        A quantized linear weight comes as a :class:`QuantizedTensor` with the ``quantizer`` that runs it.

        :raises ValueError: a tensor whose shape is not its parameter's.
        """
        full_name = name
        name = name.removeprefix("model.")
        if name == "lm_head.weight" and self.config.tie_word_embeddings:
            return ""
        if not self._on_this_stage(name):
            return ""
        shard_index = 0
        for ckpt_name, (merged, index) in self.packed_modules.items():
            if f".{ckpt_name}." in name:
                name, shard_index = name.replace(f".{ckpt_name}.", f".{merged}."), index
                break
        module_name, _, param_name = name.rpartition(".")
        try:
            module = self.get_submodule(module_name)
            param = getattr(module, param_name)
        except AttributeError:
            return None
        slot = f"{name}#{shard_index}"
        if isinstance(tensor, QuantizedTensor):
            if not isinstance(module, QuantizableLinear) or param_name != "weight" or quantizer is None:
                return None
            module.add_quantized_shard(tensor, quantizer, shard_index, full_name)
            return slot
        if not isinstance(param, torch.Tensor):
            return None
        loader = getattr(module, "load_shard", None)
        with torch.no_grad():
            if loader is not None:
                loader(param, tensor.to(param.dtype), shard_index)
            else:
                check_shape(tensor, tuple(param.shape))
                param.copy_(tensor.to(param.dtype))
        return slot
