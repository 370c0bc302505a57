"""The shape of a Llama-family decoder, whatever format its weights come in."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from rtxcore.errors import ModelLoadError


@dataclass(slots=True)
class RopeScaling:
    # "llama3" (Llama 3.1 frequency bands) or "linear" (position interpolation).
    kind: str
    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position: int = 8192


@dataclass(slots=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    max_position: int
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = False
    head_dim: int = 0  # 0: hidden_size // num_heads
    rope_scaling: RopeScaling | None = None
    # Qwen2 puts biases on the q/k/v projections.
    attention_bias: bool = False
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    name: str = "model"

    def __post_init__(self) -> None:
        if self.head_dim == 0:
            self.head_dim = self.hidden_size // max(self.num_heads, 1)
        for attr in ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "intermediate_size",
                     "max_position", "head_dim"):
            if getattr(self, attr) <= 0:
                raise ModelLoadError(f"model config: {attr} must be positive, got {getattr(self, attr)}")
        if self.num_heads % self.num_kv_heads:
            raise ModelLoadError(
                f"model config: num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})")

    def kv_cache_bytes_per_token(self, itemsize: int) -> int:
        """Bytes of K and V that one token takes across all layers, at ``itemsize`` bytes per element."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * itemsize

    @property
    def num_params(self) -> int:
        d, f, v = self.hidden_size, self.intermediate_size, self.vocab_size
        q = self.num_heads * self.head_dim
        kv = self.num_kv_heads * self.head_dim
        per_layer = d * (q + 2 * kv) + q * d + 3 * d * f + 2 * d
        embed = v * d * (1 if self.tie_word_embeddings else 2)
        return self.num_layers * per_layer + embed + d

    @classmethod
    def from_hf(cls, cfg: dict[str, Any], name: str = "model") -> "ModelConfig":
        """Build from a Hugging Face ``config.json`` of a Llama, Mistral or Qwen2 model."""
        try:
            scaling = cfg.get("rope_scaling") or cfg.get("rope_parameters")
            rope_theta = cfg.get("rope_theta") or (scaling or {}).get("rope_theta") or 10000.0
            rope = None
            if scaling and scaling.get("rope_type", scaling.get("type")) in ("llama3", "linear"):
                kind = scaling.get("rope_type", scaling.get("type"))
                rope = RopeScaling(
                    kind=kind,
                    factor=float(scaling["factor"]),
                    low_freq_factor=float(scaling.get("low_freq_factor", 1.0)),
                    high_freq_factor=float(scaling.get("high_freq_factor", 4.0)),
                    original_max_position=int(scaling.get("original_max_position_embeddings", 8192)),
                )
            eos = cfg.get("eos_token_id")
            eos_ids = eos if isinstance(eos, list) else ([eos] if eos is not None else [])
            return cls(
                vocab_size=cfg["vocab_size"],
                hidden_size=cfg["hidden_size"],
                num_layers=cfg["num_hidden_layers"],
                num_heads=cfg["num_attention_heads"],
                num_kv_heads=cfg.get("num_key_value_heads", cfg["num_attention_heads"]),
                intermediate_size=cfg["intermediate_size"],
                max_position=cfg.get("max_position_embeddings", 4096),
                rope_theta=float(rope_theta),
                rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-5)),
                tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
                head_dim=cfg.get("head_dim") or 0,
                rope_scaling=rope,
                attention_bias=bool(cfg.get("attention_bias", cfg.get("model_type") == "qwen2")),
                bos_token_id=cfg.get("bos_token_id"),
                eos_token_ids=list(eos_ids),
                name=name,
            )
        except KeyError as exc:
            raise ModelLoadError(f"config.json lacks the field {exc.args[0]!r}") from None

    def to_hf(self) -> dict[str, Any]:
        """A Hugging Face ``LlamaConfig``-compatible dict (for baselines and exports)."""
        out: dict[str, Any] = {
            "model_type": "llama",
            "architectures": ["LlamaForCausalLM"],
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "intermediate_size": self.intermediate_size,
            "max_position_embeddings": self.max_position,
            "rope_theta": self.rope_theta,
            "rms_norm_eps": self.rms_norm_eps,
            "tie_word_embeddings": self.tie_word_embeddings,
            "head_dim": self.head_dim,
            "attention_bias": self.attention_bias,
            "hidden_act": "silu",
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_ids[0] if len(self.eos_token_ids) == 1 else (self.eos_token_ids or None),
        }
        if self.rope_scaling is not None:
            s = self.rope_scaling
            out["rope_scaling"] = {
                "rope_type": s.kind, "factor": s.factor, "low_freq_factor": s.low_freq_factor,
                "high_freq_factor": s.high_freq_factor, "original_max_position_embeddings": s.original_max_position,
            }
        return out
