"""The model a plan would write, in memory: the original source's config and tokenizer with the plan's tensors, so
that the planner scores each step without writing a checkpoint (``rtxcore.quant.pipeline``)."""

from __future__ import annotations

import torch

from rtxcore.contracts.quantizer import QuantizedTensor
from rtxcore.models.source import DerivedSource, ModelSource


class PlannedSource(DerivedSource):
    """A model source whose weights are a plan's, in memory: the original's config and tokenizer."""

    def __init__(self, base: ModelSource, tensors: dict[str, torch.Tensor | QuantizedTensor], methods: list[str]):
        super().__init__(base)
        self.tensors, self.methods = tensors, tuple(methods)

    def num_weights(self) -> int:
        return len(self.tensors)

    def weights(self, progress=None, device="cpu", dtype=torch.float32):
        yield from self.tensors.items()

    def quantization_methods(self) -> tuple[str, ...]:
        return self.methods
