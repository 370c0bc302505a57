"""int8 weight-only quantization, one symmetric scale per output channel (W8A16)."""

from __future__ import annotations

import torch

from rtx_kernels import quant_reference
from rtxcore.contracts.quantizer import LayerStats, QuantizedTensor, Quantizer, narrow_inputs, require_tensor
from rtxcore.hookspecs import hookimpl

_LEVELS = 127


class Int8Quantizer(Quantizer):
    # Rounding error is uniform within half a step; a Gaussian row's maximum is about 3 standard deviations (4.5 in
    # the widest rows tested), so the relative error is about 4.5 / 127 / sqrt(12) = 0.010 at worst.
    max_relative_error = 0.015
    layer_error_budget = 0.03
    fallback = None

    @classmethod
    def describe(cls) -> dict[str, object]:
        return {"description": "int8 weights, per-output-channel symmetric scales; activations stay 16-bit",
                "bits": 8}

    def quantize(self, weight: torch.Tensor, stats: LayerStats | None = None) -> QuantizedTensor:
        w = weight.float()
        scale = w.abs().amax(dim=1).clamp_min(1e-12) / _LEVELS
        values = (w / scale[:, None]).round().clamp(-_LEVELS, _LEVELS).to(torch.int8)
        return QuantizedTensor("int8", {"weight": values, "weight_scale": scale}, tuple(weight.shape), weight.dtype,
                               {"bits": 8, "strategy": "channel", "symmetric": True})

    def dequantize(self, qtensor: QuantizedTensor) -> torch.Tensor:
        t = qtensor.tensors
        return quant_reference.dequantize_int8(t["weight"], t["weight_scale"], qtensor.dtype)

    def slice_inputs(self, qtensor: QuantizedTensor, start: int, size: int) -> QuantizedTensor:
        # One scale per output row: a row's columns keep it.
        return narrow_inputs(qtensor, start, size, {"weight": 1})

    def check(self, qtensor: QuantizedTensor) -> None:
        n, k = qtensor.shape
        require_tensor(qtensor, "weight", (n, k), torch.int8)
        require_tensor(qtensor, "weight_scale", (n,), torch.float32)

    def linear(self, x: torch.Tensor, qtensor: QuantizedTensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        t = qtensor.tensors
        if x.is_cuda:
            if not quant_reference.HAS_TRITON:
                return super().linear(x, qtensor, bias)
            from rtx_kernels.quant_matmul import int8_linear

            return int8_linear(x, t["weight"], t["weight_scale"], bias)
        return quant_reference.int8_linear_cpu(x, t["weight"], t["weight_scale"], bias)


@hookimpl
def register_quantizers(register) -> None:
    register("int8", Int8Quantizer)
