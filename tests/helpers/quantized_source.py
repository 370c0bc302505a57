"""A random-weight model whose linear weights come quantized, as from a checkpoint ``rtx quantize`` wrote: for tests
of loading stored forms (tensor-parallel ranks cut them) without a tokenizer or calibration text. A module of its
own so that spawned ranks can unpickle it."""

from __future__ import annotations

import torch

from rtxcore.models.dummy import DummySource
from rtxcore.registry import load_plugins

_LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class QuantizedDummySource(DummySource):
    def __init__(self, shape: str, method: str, seed: int = 0):
        super().__init__(shape, seed)
        self.method = method

    def quantization_methods(self) -> tuple[str, ...]:
        return (self.method,)

    def weights(self, progress=None, device="cpu", dtype=torch.float32):
        quantizer = load_plugins().create("quantizer", self.method)
        # Quantized from float32, as rtx quantize does, whatever dtype the model loads in.
        for name, tensor in super().weights(progress, device, torch.float32):
            if name.endswith(".weight") and name.split(".")[-2] in _LINEAR:
                yield name, quantizer.quantize(tensor)
            else:
                yield name, tensor
