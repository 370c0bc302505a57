"""TensorRT optimization profiles for the dense KV-cache graph: the ranges of every dynamic input's shape.

The backend runs two kinds of call (see ``graph_runtime/dense_step.py``), so the engine has two profiles, each
tuned for its kind: decodes (up to ``max_batch`` requests, one new token each) and prefill chunks (one request, up
to ``max_model_len`` new tokens). Past lengths run from 1 (a call always has one past column) to the context.
"""

from __future__ import annotations

from dataclasses import dataclass

from rtxcore.models.config import ModelConfig

Shape = tuple[int, ...]


@dataclass(frozen=True, slots=True)
class ShapeRange:
    min: Shape
    opt: Shape
    max: Shape

    def __post_init__(self) -> None:
        if not (len(self.min) == len(self.opt) == len(self.max)):
            raise ValueError(f"shape range of mixed ranks: {self}")
        if not all(lo <= mid <= hi for lo, mid, hi in zip(self.min, self.opt, self.max)):
            raise ValueError(f"shape range not ordered min <= opt <= max: {self}")

    def contains(self, shape: Shape) -> bool:
        return len(shape) == len(self.min) and all(lo <= s <= hi for lo, s, hi in zip(self.min, shape, self.max))


@dataclass(frozen=True, slots=True)
class Profile:
    name: str
    shapes: dict[str, ShapeRange]

    def accepts(self, shapes: dict[str, Shape]) -> bool:
        return all(self.shapes[name].contains(shape) for name, shape in shapes.items())

    def as_key(self) -> dict:
        return {name: [list(r.min), list(r.opt), list(r.max)] for name, r in sorted(self.shapes.items())}


def _ranges(batch: tuple[int, int, int], tokens: tuple[int, int, int], past: tuple[int, int, int],
            logits: tuple[int, int, int], cache_shape: Shape) -> dict[str, ShapeRange]:
    """Each input's range, given (min, opt, max) of the batch, new-token, past and logits-row axes."""
    def shape(i: int, *axes) -> Shape:
        return tuple(a[i] if isinstance(a, tuple) else a for a in axes)

    keys = tuple(p + t for p, t in zip(past, tokens))
    out = {}
    for name, axes in (("input_ids", (batch, tokens)), ("positions", (batch, tokens)),
                       ("attention_bias", (batch, tokens, keys)), ("logits_rows", (logits,)),
                       ("past_slots", (batch, past))):
        out[name] = ShapeRange(shape(0, *axes), shape(1, *axes), shape(2, *axes))
    for name in ("key_cache", "value_cache"):
        out[name] = ShapeRange(cache_shape, cache_shape, cache_shape)
    return out


def compute_profiles(cfg: ModelConfig, max_batch: int, max_model_len: int, num_slots: int) -> tuple[Profile, ...]:
    """The decode and prefill profiles for a model, a batch limit, a context limit and a cache of ``num_slots``."""
    if max_batch < 1 or max_model_len < 2 or num_slots < 1:
        raise ValueError(f"profiles need max_batch >= 1, max_model_len >= 2 and a cache; got {max_batch}, "
                         f"{max_model_len}, {num_slots} slots")
    cache = (cfg.num_layers * num_slots, cfg.num_kv_heads, cfg.head_dim)
    longest_past = max_model_len - 1
    # Tuned for the common case: a batch of a few dozen decodes at a quarter of the context, a 512-token chunk.
    past_opt = max(1, longest_past // 4)
    decode_batch = (1, min(max_batch, 32), max_batch)
    decode = Profile("decode", _ranges(decode_batch, (1, 1, 1), (1, past_opt, longest_past), decode_batch, cache))
    # A chunk usually wants one logits row (its last token's); scoring a prompt wants one per token.
    prefill = Profile("prefill", _ranges((1, 1, 1), (1, min(512, max_model_len), max_model_len),
                                         (1, 1, longest_past), (1, 1, max_model_len), cache))
    return decode, prefill


def pick_profile(profiles: tuple[Profile, ...], shapes: dict[str, Shape]) -> int:
    """Index of the first profile whose ranges hold every shape of a call."""
    for i, profile in enumerate(profiles):
        if profile.accepts(shapes):
            return i
    raise ValueError(f"no optimization profile accepts the shapes {shapes}")
