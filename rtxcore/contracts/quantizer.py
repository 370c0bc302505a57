"""Quantizer contract: store a weight in fewer bits and give back an approximation on demand."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field

import torch


@dataclass(slots=True)
class QuantizedTensor:
    # Name of the method that produced it (the quantizer's registered name).
    method: str
    # Tensors that together encode the weight (packed values, scales, zero points...), saved as they are.
    tensors: dict[str, torch.Tensor]
    # The original weight's shape and dtype, to rebuild it.
    shape: tuple[int, ...]
    dtype: torch.dtype
    # Method-specific settings (group size, bits...), JSON-serializable.
    meta: dict = field(default_factory=dict)


class Quantizer(ABC):
    #: Largest relative error (||W - dequant(quant(W))|| / ||W||) the quantizer promises on Gaussian weights.
    max_relative_error: float = 0.0

    @abstractmethod
    def quantize(self, weight: torch.Tensor) -> QuantizedTensor:
        """:param weight: a 2-D linear weight [out_features, in_features]."""

    @abstractmethod
    def dequantize(self, qtensor: QuantizedTensor) -> torch.Tensor:
        """Rebuild an approximation of the original weight."""
