"""Quantization-aware training hooks: a model's linear layers replaced by ones that compute with the rounding a
quantizer plugin applies (its ``fake_quantize`` and ``fake_quantize_input``), so that a training loop can fine-tune
the float weights to what the method will store. After training, ``rtx quantize`` stores the weights as usual.

    quantizer = load_plugins().create("quantizer", "int4")
    prepare_qat(model, quantizer)          # in place; returns the layers it wrapped
    loss = criterion(model(x), y); loss.backward(); optimizer.step()
    strip_qat(model)                       # back to plain nn.Linear holding the trained float weights
"""

from __future__ import annotations

from collections.abc import Callable

import torch.nn.functional as F
from torch import Tensor, nn

from rtxcore.contracts.quantizer import Quantizer


class FakeQuantLinear(nn.Module):
    """An ``nn.Linear`` whose forward sees its weight (and input, for methods that round activations) as
    ``quantizer`` rounds them; gradients pass straight through to the float weight."""

    def __init__(self, linear: nn.Linear, quantizer: Quantizer):
        super().__init__()
        self.linear = linear
        self.quantizer = quantizer

    def forward(self, x: Tensor) -> Tensor:
        q = self.quantizer
        return F.linear(q.fake_quantize_input(x), q.fake_quantize(self.linear.weight), self.linear.bias)


def prepare_qat(model: nn.Module, quantizer: Quantizer,
                include: Callable[[str, nn.Linear], bool] = lambda name, module: True) -> list[str]:
    """Wrap every ``nn.Linear`` of ``model`` that ``include(name, module)`` accepts; returns their names."""
    wrapped = []
    for parent_name, parent in list(model.named_modules()):
        for child_name, child in list(parent.named_children()):
            name = f"{parent_name}.{child_name}" if parent_name else child_name
            if isinstance(child, nn.Linear) and include(name, child):
                setattr(parent, child_name, FakeQuantLinear(child, quantizer))
                wrapped.append(name)
    return wrapped


def strip_qat(model: nn.Module) -> None:
    """Undo :func:`prepare_qat`: each wrapper replaced by its (trained) ``nn.Linear``."""
    for parent in list(model.modules()):
        for child_name, child in list(parent.named_children()):
            if isinstance(child, FakeQuantLinear):
                setattr(parent, child_name, child.linear)
