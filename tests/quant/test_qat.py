"""Quantization-aware training: a model whose linear layers compute with a quantizer's rounding trains (its loss
falls) and computes exactly what the stored form will."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from rtxcore.quant.qat import FakeQuantLinear, prepare_qat, strip_qat
from rtxcore.registry import load_plugins


def model_and_data(seed: int = 0):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(128, 256), nn.GELU(), nn.Linear(256, 128))
    teacher = nn.Sequential(nn.Linear(128, 256), nn.Tanh(), nn.Linear(256, 128))
    x = torch.randn(512, 128)
    with torch.no_grad():
        y = teacher(x)
    return model, x, y


@pytest.mark.parametrize("method", ["int4", "int8", "fp8"])
def test_a_fake_quantized_model_trains_and_computes_what_will_be_stored(method):
    quantizer = load_plugins().create("quantizer", method)
    model, x, y = model_and_data()
    assert prepare_qat(model, quantizer) == ["0", "2"]
    # The forward is the stored form's: the same output as the quantizer's own linear on its quantized weight.
    layer = model[0]
    assert isinstance(layer, FakeQuantLinear)
    stored = quantizer.quantize(layer.linear.weight.detach())
    torch.testing.assert_close(layer(x[:8]), quantizer.linear(x[:8], stored, layer.linear.bias), rtol=1e-5, atol=1e-5)
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(60):
        optimizer.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    # Gradients reached the float weights through the rounding, and the loss fell.
    assert losses[-1] < 0.5 * losses[0], (losses[0], losses[-1])
    strip_qat(model)
    assert isinstance(model[0], nn.Linear) and isinstance(model[2], nn.Linear)
