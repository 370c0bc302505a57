"""fp8 in the exported graph: each linear layer as QuantizeLinear/DequantizeLinear (float8 e4m3) around a MatMul.

TensorRT builds fp8 layers only from explicit Q/DQ nodes, and needs a static scale per activation tensor, so the
weights take the fp8 quantizer's per-output-channel scales and each layer's input one scale measured on
calibration text (its largest magnitude over 448). ONNX Runtime runs the same nodes on the CPU as rounding around a
float MatMul, which is how this file's graphs are tested here.
"""

from __future__ import annotations

import random

import torch

from rtx_plugins.backends.torch_backend.quantized import QuantizedWeight
from rtx_plugins.quantizers.fp8 import FP8, FP8Quantizer
from rtxcore.contracts.backend import BackendOptions
from rtxcore.contracts.quantizer import QuantizedTensor
from rtxcore.errors import ConfigError
from rtxcore.models.source import ModelSource
from rtxcore.quant import calibration
from rtxcore.quant.evaluation import prefill_logits

# Opset 19 is the first whose QuantizeLinear and DequantizeLinear take float8.
FP8_OPSET = 19
_FP8_MAX = float(torch.finfo(FP8).max)
CALIBRATION_CHUNKS = 4
CALIBRATION_LEN = 256


def graph_quantization(options: BackendOptions) -> str | None:
    """The quantization a graph backend exports for ``options``: None, or "fp8"."""
    if options.quantizer is None:
        return None
    if isinstance(options.quantizer, FP8Quantizer):
        return "fp8"
    raise ConfigError(f"graph backends export fp8 only; {type(options.quantizer).__name__} weights cannot be exported")


class _QDQMatMul(torch.autograd.Function):
    """``x @ W^T`` with x rounded to fp8 at a static scale and W stored in fp8 with one scale per output row."""

    @staticmethod
    def forward(ctx, x, weight, weight_scale, x_scale):
        xq = (x.float() / x_scale).clamp(-_FP8_MAX, _FP8_MAX).to(FP8).float() * x_scale
        return (xq @ (weight.float() * weight_scale[:, None]).t()).to(x.dtype)

    @staticmethod
    def symbolic(g, x, weight, weight_scale, x_scale):
        zero = g.op("Constant", value_t=torch.zeros((), dtype=FP8))
        x_dq = g.op("DequantizeLinear", g.op("QuantizeLinear", x, x_scale, zero), x_scale)
        w_dq = g.op("DequantizeLinear", weight, weight_scale, axis_i=0)
        return g.op("MatMul", x_dq, g.op("Transpose", w_dq, perm_i=[1, 0]))


class StaticFP8(FP8Quantizer):
    """The fp8 quantizer's weights with one static activation scale, run as :class:`_QDQMatMul` (exportable)."""

    def __init__(self, x_scale: float):
        self.x_scale = torch.tensor(x_scale, dtype=torch.float32)

    def rounded_rows(self, qtensor: QuantizedTensor, num_rows: int, device: torch.device) -> None:
        # Its input is rounded at the static scale inside the exported graph: never beforehand.
        return None

    def linear(self, x: torch.Tensor, qtensor: QuantizedTensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        t = qtensor.tensors
        y = _QDQMatMul.apply(x, t["weight"], t["weight_scale"], self.x_scale)
        return y if bias is None else y + bias


def quantize_for_export(loader, source: ModelSource) -> None:
    """Give every decoder linear layer of the torch backend ``loader`` its fp8 weights and a static input scale,
    measured over calibration text (random token ids for a model without a tokenizer)."""
    chunks = _calibration_chunks(source)
    loader.allocate_kv_cache(2 + CALIBRATION_LEN // 16, 16)
    layers = loader.model.linear_layers()
    stats = calibration.collect_stats(layers, lambda ids: prefill_logits(loader, ids, 16, False), chunks,
                                      hessian=False)
    weights = FP8Quantizer()
    for name, layer in layers.items():
        x_scale = max(stats[name].abs_max.max().item(), 1e-6) / _FP8_MAX
        layer.quantized = QuantizedWeight(StaticFP8(x_scale), weights.quantize(layer.weight.data))


def _calibration_chunks(source: ModelSource) -> list[list[int]]:
    tokenizer = source.tokenizer()
    cfg = source.config
    if tokenizer is None:
        rng = random.Random(0)
        return [[rng.randrange(cfg.vocab_size) for _ in range(CALIBRATION_LEN)] for _ in range(CALIBRATION_CHUNKS)]
    return calibration.calibration_chunks(tokenizer, cfg.bos_token_id, CALIBRATION_LEN * CALIBRATION_CHUNKS,
                                          CALIBRATION_LEN)
