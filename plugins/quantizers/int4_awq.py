"""int4-awq: the int4 format of ``int4`` with activation-aware scaling (AWQ-style). Input features that carry large
activations on calibration text matter more to the output: the weight's columns are scaled up by
``s_j = mean|x_j| ** ALPHA`` before rounding (so they round more finely within their groups) and the layer divides
its input by ``s`` when it runs, which leaves the exact product unchanged and puts the rounding where it costs less.

``s`` depends on the calibration statistics only (never on the weight): layers that run fused share their input, so
q, k and v get the same ``s`` and still run as one kernel. That is why ALPHA is fixed rather than searched per layer
as AWQ's reference implementation does; 0.5 is the value its search most often returns.
"""

from __future__ import annotations

import torch

from rtx_plugins.quantizers.int4 import Int4Quantizer
from rtxcore.contracts.quantizer import LayerStats, QuantizedTensor, narrow_inputs, require_tensor
from rtxcore.hookspecs import hookimpl

ALPHA = 0.5


def activation_scale(stats: LayerStats | None, in_features: int) -> torch.Tensor:
    """``s`` [in_features], normalised to a geometric mean of 1 (ones without statistics)."""
    if stats is None or stats.sample.numel() == 0:
        return torch.ones(in_features)
    mean_abs = stats.sample.float().abs().mean(dim=0).clamp_min(1e-6)
    s = mean_abs ** ALPHA
    return (s / s.log().mean().exp()).float().contiguous()


class Int4AWQQuantizer(Int4Quantizer):
    calibrated = True
    uses_hessian = False
    name = "int4-awq"

    @classmethod
    def describe(cls) -> dict[str, object]:
        return {"description": "int4 weights in groups of 128 with activation-aware input scaling (AWQ-style, "
                               f"alpha {ALPHA}); plain int4 without calibration data", "bits": 4}

    def quantize(self, weight: torch.Tensor, stats: LayerStats | None = None) -> QuantizedTensor:
        # Statistics live on the CPU; a weight quantized as it loads (rtx serve --quantization) may be on the GPU.
        s = activation_scale(stats, weight.shape[1]).to(weight.device)
        base = super().quantize(weight.float() * s[None, :])
        return QuantizedTensor(self.name, {**base.tensors, "input_smooth": s}, tuple(weight.shape), weight.dtype,
                               {**base.meta, "awq_alpha": ALPHA})

    def dequantize(self, qtensor: QuantizedTensor) -> torch.Tensor:
        scaled = super().dequantize(qtensor).float()
        return (scaled / qtensor.tensors["input_smooth"][None, :]).to(qtensor.dtype)

    def slice_inputs(self, qtensor: QuantizedTensor, start: int, size: int) -> QuantizedTensor:
        group = qtensor.meta["group_size"]
        return narrow_inputs(qtensor, start, size, {"weight_packed": 8, "weight_scale": group,
                                                    "weight_zero_point": group, "input_smooth": 1})

    def check(self, qtensor: QuantizedTensor) -> None:
        super().check(qtensor)
        require_tensor(qtensor, "input_smooth", (qtensor.shape[1],), torch.float32)

    def linear(self, x: torch.Tensor, qtensor: QuantizedTensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        # In x's dtype: one kernel, where a float32 s would promote x and need a second to cast it back.
        return super().linear(x / qtensor.tensors["input_smooth"].to(x.dtype), qtensor, bias)


@hookimpl
def register_quantizers(register) -> None:
    register("int4-awq", Int4AWQQuantizer)
