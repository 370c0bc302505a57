"""Random weights of a named shape, for benchmarks on machines the real checkpoints cannot reach.

Same idea as vLLM's ``load_format=dummy``: the model runs the real computation on weights drawn from a fixed seed,
so two loads of the same shape (ours and a baseline's) see identical tensors.
"""

from __future__ import annotations

import zlib
from typing import Iterator

import torch

from rtxcore.errors import ModelLoadError
from rtxcore.models.config import ModelConfig
from rtxcore.models.source import ModelSource, Progress

SHAPES: dict[str, ModelConfig] = {
    "llama-1b": ModelConfig(
        vocab_size=128256, hidden_size=2048, num_layers=16, num_heads=32, num_kv_heads=8, intermediate_size=8192,
        max_position=131072, rope_theta=500000.0, tie_word_embeddings=True, name="llama-1b",
        bos_token_id=128000, eos_token_ids=[128001]),
    "llama-8b": ModelConfig(
        vocab_size=128256, hidden_size=4096, num_layers=32, num_heads=32, num_kv_heads=8, intermediate_size=14336,
        max_position=131072, rope_theta=500000.0, tie_word_embeddings=False, name="llama-8b",
        bos_token_id=128000, eos_token_ids=[128001]),
    "smollm2-135m": ModelConfig(
        vocab_size=49152, hidden_size=576, num_layers=30, num_heads=9, num_kv_heads=3, intermediate_size=1536,
        max_position=8192, rope_theta=100000.0, tie_word_embeddings=True, name="smollm2-135m",
        bos_token_id=1, eos_token_ids=[2]),
    # A few-layer shape for fast tests.
    "tiny": ModelConfig(
        vocab_size=512, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=128,
        max_position=2048, rope_theta=10000.0, tie_word_embeddings=False, name="tiny",
        bos_token_id=1, eos_token_ids=[2]),
}


class DummySource(ModelSource):
    def __init__(self, shape: str, seed: int = 0):
        if shape not in SHAPES:
            raise ModelLoadError(f"unknown dummy shape {shape!r}; known shapes: {', '.join(sorted(SHAPES))}")
        self._config = SHAPES[shape]
        self.name = f"dummy:{shape}"
        self.path = ""
        self.seed = seed

    @property
    def config(self) -> ModelConfig:
        return self._config

    def tokenizer(self) -> None:
        return None

    def _shapes(self) -> list[tuple[str, tuple[int, ...]]]:
        c = self._config
        q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        out: list[tuple[str, tuple[int, ...]]] = [("model.embed_tokens.weight", (c.vocab_size, c.hidden_size))]
        for i in range(c.num_layers):
            p = f"model.layers.{i}."
            out += [
                (p + "input_layernorm.weight", (c.hidden_size,)),
                (p + "self_attn.q_proj.weight", (q, c.hidden_size)),
                (p + "self_attn.k_proj.weight", (kv, c.hidden_size)),
                (p + "self_attn.v_proj.weight", (kv, c.hidden_size)),
                (p + "self_attn.o_proj.weight", (c.hidden_size, q)),
                (p + "post_attention_layernorm.weight", (c.hidden_size,)),
                (p + "mlp.gate_proj.weight", (c.intermediate_size, c.hidden_size)),
                (p + "mlp.up_proj.weight", (c.intermediate_size, c.hidden_size)),
                (p + "mlp.down_proj.weight", (c.hidden_size, c.intermediate_size)),
            ]
        out.append(("model.norm.weight", (c.hidden_size,)))
        if not c.tie_word_embeddings:
            out.append(("lm_head.weight", (c.vocab_size, c.hidden_size)))
        return out

    def num_weights(self) -> int:
        return len(self._shapes())

    def weights(self, progress: Progress | None = None, device: str | torch.device = "cpu",
                dtype: torch.dtype = torch.float32) -> Iterator[tuple[str, torch.Tensor]]:
        shapes = self._shapes()
        for done, (name, shape) in enumerate(shapes, 1):
            # Drawn on the CPU from a per-tensor seed: CUDA and CPU generators give different streams for the same
            # seed, and the weights must not depend on where they are loaded.
            gen = torch.Generator().manual_seed(self.seed * 1_000_003 + zlib.crc32(name.encode()))
            t = torch.randn(shape, generator=gen, dtype=torch.float32)
            # Norm weights near 1 keep activations in range through many layers.
            t = 1.0 + 0.02 * t if len(shape) == 1 else t * 0.02
            yield name, t.to(device=device, dtype=dtype)
            if progress:
                progress(done, len(shapes))
