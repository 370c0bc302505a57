"""Reading a llama.cpp GGUF file: its config, its tokenizer, and its weights under Hugging Face names."""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Callable, Iterator
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np
import torch

from rtxcore.errors import ModelLoadError
from rtxcore.models.config import ModelConfig, RopeScaling
from rtxcore.models.gguf_dequant import dequantize
from rtxcore.models.gguf_index import MAGIC, GGUFFormatError, GGUFIndex, GGUFTensor
from rtxcore.models.source import ModelSource, Progress
from rtxcore.tokenizer import Tokenizer
from rtxcore.tokenizer.gguf_vocab import gguf_eos_token_ids

# ``general.architecture`` values whose tensors follow the Llama layout. "mistral" is what transformers calls a
# llama-architecture file named Mistral; llama.cpp itself writes "llama" for those.
SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2")
# llama.cpp's converter reorders the rows of Q and K for these (see _undo_rope_permutation); not for Qwen2.
_ROPE_PERMUTED = frozenset({"llama", "mistral"})

_GLOBAL_TENSORS = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_LAYER_TENSORS = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
# Llama 3's precomputed RoPE frequency factors: read into ModelConfig.rope_scaling, not a model parameter.
_ROPE_FREQS = "rope_freqs.weight"

_PRINTABLE_ITEMS = 8


class GGUFCheckpoint:
    """A GGUF file of a Llama-family model (Llama, Mistral, Qwen2, SmolLM, ...).

    Opening reads the metadata and the tensor index (0.1 s for a 49k-token vocabulary); tensor data stays
    memory-mapped and is dequantized one tensor at a time by :meth:`weights`.

    :raises ModelLoadError: missing, unreadable, truncated or corrupt file, not GGUF, or an architecture or
        tensor this loader does not know.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self._index = _open_index(self.path)
        self.architecture: str = self._index.fields.get("general.architecture", "<missing>")
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ModelLoadError(f"{self.path}: architecture {self.architecture!r} is not supported "
                                 f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)})")
        self._tensors = {t.name: t for t in self._index.tensors}
        self._plan = [(self._hf_name(name), t) for name, t in self._tensors.items() if name != _ROPE_FREQS]

    # -- metadata --------------------------------------------------------------------------------------------

    @cached_property
    def metadata(self) -> dict[str, Any]:
        """Every key-value pair of the file as Python values: strings decoded, arrays as lists.

        Includes the whole vocabulary (``tokenizer.ggml.tokens`` / ``merges``); print
        :meth:`metadata_summary` instead.
        """
        return self._index.fields

    def metadata_summary(self) -> dict[str, Any]:
        """:attr:`metadata` with long arrays (the vocabulary, merges, token types) replaced by their length."""
        return {key: f"<{len(value)} items>" if isinstance(value, list) and len(value) > _PRINTABLE_ITEMS else value
                for key, value in self.metadata.items()}

    @property
    def tensor_names(self) -> list[str]:
        """The file's own tensor names (``blk.0.attn_q.weight``, ...), in file order."""
        return list(self._tensors)

    @property
    def num_tensors(self) -> int:
        """How many tensors :meth:`weights` yields."""
        return len(self._plan)

    def model_config(self) -> ModelConfig:
        """The model's shape, from the ``{architecture}.*`` keys and the tensors present."""
        meta, arch = self.metadata, self.architecture

        def get(key: str, default: Any = ...) -> Any:
            value = meta.get(f"{arch}.{key}", default)
            if value is ...:
                raise ModelLoadError(f"{self.path}: metadata lacks {arch}.{key}")
            return value

        num_heads = _per_model(get("attention.head_count"), f"{arch}.attention.head_count", self.path)
        num_kv_heads = _per_model(get("attention.head_count_kv", num_heads), f"{arch}.attention.head_count_kv",
                                  self.path)
        hidden_size = int(get("embedding_length"))
        head_dim = get("attention.key_length", None)
        if head_dim is None and arch in _ROPE_PERMUTED:
            # For Llama and Mistral the rotary dimension is the head size; Qwen2 does not write it.
            head_dim = get("rope.dimension_count", None)
        embed = self._tensors.get("token_embd.weight")
        if embed is None:
            raise ModelLoadError(f"{self.path}: no token_embd.weight tensor")
        rope_theta = float(get("rope.freq_base", 10000.0))
        head_dim = int(head_dim or hidden_size // num_heads)
        eos_ids = gguf_eos_token_ids(meta)
        return ModelConfig(
            vocab_size=int(embed.shape[-1]),  # GGUF lists dimensions innermost first: [hidden, vocab]
            hidden_size=hidden_size,
            num_layers=int(get("block_count")),
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            intermediate_size=int(get("feed_forward_length")),
            max_position=int(get("context_length")),
            rope_theta=rope_theta,
            rms_norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-5)),
            tie_word_embeddings="output.weight" not in self._tensors,
            head_dim=head_dim,
            rope_scaling=self._rope_scaling(get, rope_theta, head_dim),
            attention_bias="blk.0.attn_q.bias" in self._tensors,
            bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
            eos_token_ids=eos_ids,
            name=str(meta.get("general.name") or self.path.stem),
        )

    def tokenizer(self) -> Tokenizer:
        """The tokenizer stored in the file's metadata."""
        try:
            return Tokenizer.from_gguf(self.metadata)
        except ModelLoadError as exc:
            raise ModelLoadError(f"{self.path}: {exc}") from None

    # -- weights ---------------------------------------------------------------------------------------------

    def weights(self, progress: Progress | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield ``(hf_name, float32 tensor)`` one tensor at a time, dequantized, in Hugging Face Llama layout.

        Names are those of ``LlamaForCausalLM.state_dict()``; ``lm_head.weight`` only when the file has its own
        (otherwise the embeddings are tied). The values equal what transformers loads from the same file.

        :param progress: called as ``progress(done, total)`` after each tensor is ready.
        """
        config = self.model_config() if self.architecture in _ROPE_PERMUTED else None
        total = len(self._plan)
        for done, (hf_name, tensor) in enumerate(self._plan, start=1):
            values = self._dequantize(tensor)
            if config is not None and ".attn_q." in tensor.name:
                values = _undo_rope_permutation(values, config.num_heads, tensor.name)
            elif config is not None and ".attn_k." in tensor.name:
                values = _undo_rope_permutation(values, config.num_kv_heads, tensor.name)
            if progress is not None:
                progress(done, total)
            yield hf_name, values

    # -- internals -------------------------------------------------------------------------------------------

    def _hf_name(self, gguf_name: str) -> str:
        stem, _, suffix = gguf_name.rpartition(".")
        parts = stem.split(".")
        hf: str | None = None
        if len(parts) == 1:
            hf = _GLOBAL_TENSORS.get(parts[0])
        elif len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in _LAYER_TENSORS:
            hf = f"model.layers.{parts[1]}.{_LAYER_TENSORS[parts[2]]}"
        if hf is None or suffix not in ("weight", "bias"):
            raise ModelLoadError(f"{self.path}: tensor {gguf_name!r} has no place in a {self.architecture} model")
        return f"{hf}.{suffix}"

    def _dequantize(self, tensor: GGUFTensor) -> torch.Tensor:
        try:
            # Our shapes are PyTorch's: outermost first, the reverse of GGUF's order.
            return dequantize(tensor.data, tensor.tensor_type, tuple(reversed(tensor.shape)))
        except NotImplementedError:
            raise ModelLoadError(f"{self.path}: tensor {tensor.name} is stored as {tensor.tensor_type.name}, "
                                 "which cannot be dequantized") from None

    def _rope_scaling(self, get: Callable[..., Any], rope_theta: float, head_dim: int) -> RopeScaling | None:
        kind = get("rope.scaling.type", None)
        if kind == "linear":
            return RopeScaling(kind="linear", factor=float(get("rope.scaling.factor")),
                               original_max_position=int(get("rope.scaling.original_context_length",
                                                             get("context_length"))))
        if kind not in (None, "none"):
            raise ModelLoadError(f"{self.path}: rope scaling {kind!r} is not supported (supported: linear, llama3)")
        freqs = self._tensors.get(_ROPE_FREQS)
        if freqs is None:
            return None
        return infer_llama3_rope_scaling(self._dequantize(freqs).reshape(-1).numpy(), rope_theta, head_dim,
                                         self.path)


class GGUFSource(ModelSource):
    """A ``.gguf`` file (or a directory holding exactly one, and no safetensors) as a model source."""

    @staticmethod
    def matches(path: Path) -> bool:
        if path.is_dir():
            return len(list(path.glob("*.gguf"))) == 1 and not any(path.glob("*.safetensors"))
        return path.is_file() and (path.suffix.lower() == ".gguf" or _has_magic(path))

    def __init__(self, path: Path, name: str | None = None) -> None:
        if path.is_dir():
            path = next(path.glob("*.gguf"))
        self.checkpoint = GGUFCheckpoint(path)
        self.path = str(path)
        self.name = name or path.stem
        # Served under the source's name, as Hugging Face directories are, not the file's free-text general.name.
        self._config = dataclasses.replace(self.checkpoint.model_config(), name=self.name)

    def __reduce__(self) -> tuple[type[GGUFSource], tuple[Path, str], dict[str, Any]]:
        # Pickled for the ranks of tensor and pipeline parallelism (spawned processes): a memory map cannot
        # travel, so each rank maps and indexes the file again (a fraction of a second, see gguf_index).
        return type(self), (Path(self.path), self.name), {"origin": self.origin}

    @property
    def config(self) -> ModelConfig:
        return self._config

    def tokenizer(self) -> Tokenizer:
        return self.checkpoint.tokenizer()

    def num_weights(self) -> int:
        return self.checkpoint.num_tensors

    def weights(self, progress: Progress | None = None, device: str | torch.device = "cpu",
                dtype: torch.dtype = torch.float32) -> Iterator[tuple[str, torch.Tensor]]:
        for hf_name, tensor in self.checkpoint.weights(progress):
            yield hf_name, tensor.to(device=device, dtype=dtype)


def llama3_rope_factors(scaling: RopeScaling, rope_theta: float, head_dim: int) -> np.ndarray:
    """The per-frequency divisors llama.cpp's converter writes as ``rope_freqs.weight`` for Llama 3 scaling."""
    freqs = 1.0 / (rope_theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))
    wavelen = 2 * math.pi / freqs
    old = scaling.original_max_position
    smooth = (old / wavelen - scaling.low_freq_factor) / (scaling.high_freq_factor - scaling.low_freq_factor)
    blended = 1 / ((1 - smooth) / scaling.factor + smooth)
    out = np.where(wavelen < old / scaling.high_freq_factor, 1.0,
                   np.where(wavelen > old / scaling.low_freq_factor, scaling.factor, blended))
    return out.astype(np.float32)


def infer_llama3_rope_scaling(factors: np.ndarray, rope_theta: float, head_dim: int,
                              path: Path | str = "GGUF") -> RopeScaling | None:
    """Recover Llama 3 scaling parameters from a ``rope_freqs`` tensor; None when it scales nothing.

    The file keeps only the factors. Every Llama 3.x release uses low 1, high 4 and an original context of 8192,
    differing in ``factor`` (the largest divisor); the guess is checked by recomputing the tensor.
    """
    if np.all(factors == 1.0):
        return None
    guess = RopeScaling(kind="llama3", factor=float(np.max(factors)))
    if factors.shape != (head_dim // 2,) or not np.allclose(llama3_rope_factors(guess, rope_theta, head_dim),
                                                             factors, rtol=1e-4, atol=1e-6):
        raise ModelLoadError(f"{path}: rope_freqs.weight does not match Llama 3 RoPE scaling with "
                             f"factor {guess.factor}, low/high frequency factors 1/4 and original context 8192")
    return guess


def _undo_rope_permutation(w: torch.Tensor, num_heads: int, name: str) -> torch.Tensor:
    """Restore Hugging Face's row order of a Q or K projection (weight or bias).

    llama.cpp's converter (``LlamaModel.permute``) regroups each head's rows from HF's "first half / second half"
    rotary layout into interleaved pairs: ``w.reshape(heads, 2, d/2, ...).swapaxes(1, 2)``. This is its inverse,
    the same as transformers' ``LlamaTensorProcessor._reverse_permute_weights``.
    """
    rows = w.shape[0]
    if rows % (2 * num_heads):
        raise ModelLoadError(f"tensor {name}: {rows} rows do not split into {num_heads} heads of rotary pairs")
    return w.reshape(num_heads, rows // num_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _per_model(value: Any, key: str, path: Path) -> int:
    # Some files write a per-layer list; a Llama-family model has the same count in every layer.
    if isinstance(value, list):
        if not value or len(set(value)) != 1:
            raise ModelLoadError(f"{path}: {key} differs between layers ({value[:8]}...), which is not supported")
        value = value[0]
    return int(value)


def _has_magic(path: Path) -> bool:
    try:
        with path.open("rb") as f:
            return f.read(len(MAGIC)) == MAGIC
    except OSError:
        return False


def _open_index(path: Path) -> GGUFIndex:
    if not path.exists():
        raise ModelLoadError(f"{path}: no such file")
    if not path.is_file():
        raise ModelLoadError(f"{path}: not a regular file")
    try:
        size = path.stat().st_size
        with path.open("rb") as f:
            magic = f.read(len(MAGIC))
    except OSError as exc:
        raise ModelLoadError(f"{path}: cannot be read: {exc.strerror or exc}") from None
    if magic != MAGIC:
        what = "an empty file" if size == 0 else f"it starts with {magic!r}, not {MAGIC!r}"
        raise ModelLoadError(f"{path}: not a GGUF file ({what})")
    try:
        return GGUFIndex(path)
    except OSError as exc:
        raise ModelLoadError(f"{path}: cannot be read: {exc.strerror or exc}") from None
    except GGUFFormatError as exc:
        raise ModelLoadError(f"{path}: {'' if 'truncated' in str(exc) else 'corrupt GGUF file: '}{exc}") from None
