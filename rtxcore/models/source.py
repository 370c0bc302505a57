"""What every model format provides: a shape, a tokenizer and weights (:class:`ModelSource`).

The formats (``gguf``, ``hf_dir``, ``quantized_dir``, ``dummy``) subclass it; ``rtxcore.models.resolve`` picks one
for a ``--model`` argument. None of them loads weights until ``weights()`` is iterated.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Callable, Iterator

import torch

from rtxcore.models.config import ModelConfig

if TYPE_CHECKING:
    from rtxcore.contracts.quantizer import QuantizedTensor
    from rtxcore.tokenizer import Tokenizer

Progress = Callable[[int, int], None]

class ModelSource(ABC):
    #: Name shown to users and served as the model id.
    name: str
    #: File or directory the weights come from ("" for random weights).
    path: str
    #: What ``--model`` named, file or directory: what a model signature covers ("" for random weights).
    origin: str = ""

    @property
    @abstractmethod
    def config(self) -> ModelConfig: ...

    @abstractmethod
    def tokenizer(self) -> Tokenizer | None:
        """The model's tokenizer, or None when it has none (random weights: prompts must be token ids)."""

    @abstractmethod
    def num_weights(self) -> int: ...

    @abstractmethod
    def weights(self, progress: Progress | None = None, device: str | torch.device = "cpu",
                dtype: torch.dtype = torch.float32) -> Iterator[tuple[str, torch.Tensor | QuantizedTensor]]:
        """Yield ``(hugging_face_name, tensor)`` pairs; ``device``/``dtype`` are hints a source may use to avoid copies.

        A quantized checkpoint yields its quantized linear weights as :class:`QuantizedTensor` (method in it)."""

    def quantization_methods(self) -> tuple[str, ...]:
        """The quantizer plugins whose stored forms :meth:`weights` yields (none for a float checkpoint)."""
        return ()


class DerivedSource(ModelSource):
    """A source made from another: the same name, files, config and tokenizer, other weights (a subclass's)."""

    def __init__(self, base: ModelSource):
        self.base = base
        self.name, self.path, self.origin = base.name, base.path, base.origin

    @property
    def config(self) -> ModelConfig:
        return self.base.config

    def tokenizer(self) -> Tokenizer | None:
        return self.base.tokenizer()
