"""int4 weight-only quantization (W4A16): asymmetric groups of 128 input features, by plain rounding ("int4") or
by GPTQ on calibration statistics ("int4-gptq"); "int4-g64" and "int4-g32" round in groups of 64 and 32 (a scale and
a zero point per group: 0.6 and 1.25 bits a weight more than 4, for finer rounding), formats the planner can choose
between int4 and int8 (``rtx quantize --plan --plan-formats int4,int4-g64,int4-g32,int8``)."""

from __future__ import annotations

import torch

from rtx_kernels import quant_reference
from rtx_plugins.quantizers.gptq_solver import gptq_quantize
from rtxcore.contracts.quantizer import LayerStats, QuantizedTensor, Quantizer, narrow_inputs, require_tensor
from rtxcore.hookspecs import hookimpl

_MAXQ = 15
GROUP_SIZE = 128
# Fewer features than this per group and the scales cost more than the bits they save.
_MIN_GROUP_SIZE = 32


def group_size_for(in_features: int, preferred: int = GROUP_SIZE) -> int:
    """``preferred``, or the largest power-of-two fraction of it that divides ``in_features`` (SmolLM2's 576-wide
    layers get 64): groups never straddle a row's end, so the kernels need no ragged last group."""
    size = preferred
    while size >= _MIN_GROUP_SIZE:
        if in_features % size == 0:
            return size
        size //= 2
    raise ValueError(f"int4: {in_features} input features cannot be split into groups of {_MIN_GROUP_SIZE} to "
                     f"{preferred}")


def minmax_group_params(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Scale and zero point [...] that map each group's (last dimension's) range onto 0..15."""
    low = w.amin(dim=-1).clamp_max(0)
    high = w.amax(dim=-1).clamp_min(0)
    scale = ((high - low) / _MAXQ).clamp_min(1e-8)
    zero = (-low / scale).round().clamp(0, _MAXQ)
    return scale, zero


class Int4Quantizer(Quantizer):
    # Groups of 128 Gaussian values span about 5.2 standard deviations, a step of 0.35 sd, so rounding leaves
    # 0.35 / sqrt(12) = 0.10 of the weight; groups of 64 (the tests' narrow shapes) do slightly better.
    max_relative_error = 0.13
    layer_error_budget = 0.2
    fallback = "int8"
    name = "int4"
    # Input features per scale and zero point, where the layer's width allows (group_size_for).
    group_size = GROUP_SIZE

    @classmethod
    def describe(cls) -> dict[str, object]:
        return {"description": f"int4 weights, asymmetric groups of {cls.group_size} input features, round to nearest",
                "bits": 4}

    def quantize(self, weight: torch.Tensor, stats: LayerStats | None = None) -> QuantizedTensor:
        n, k = weight.shape
        group = group_size_for(k, self.group_size)
        q, scale, zero = self._solve(weight.float(), group, stats)
        return QuantizedTensor(
            self.name,
            {"weight_packed": quant_reference.pack_int4(q), "weight_scale": scale.float().contiguous(),
             "weight_zero_point": zero.to(torch.uint8).contiguous()},
            tuple(weight.shape), weight.dtype,
            {"bits": 4, "strategy": "group", "group_size": group, "symmetric": False})

    def _solve(self, w: torch.Tensor, group: int, stats: LayerStats | None):
        n, k = w.shape
        grouped = w.reshape(n, k // group, group)
        scale, zero = minmax_group_params(grouped)
        q = ((grouped / scale[..., None]).round() + zero[..., None]).clamp(0, _MAXQ)
        return q.reshape(n, k).to(torch.uint8), scale, zero

    def dequantize(self, qtensor: QuantizedTensor) -> torch.Tensor:
        t = qtensor.tensors
        return quant_reference.dequantize_int4(t["weight_packed"], t["weight_scale"], t["weight_zero_point"],
                                               qtensor.meta["group_size"], qtensor.dtype)

    def slice_inputs(self, qtensor: QuantizedTensor, start: int, size: int) -> QuantizedTensor:
        # Eight values a word, one scale and zero point a group: a cut must fall on a group boundary.
        group = qtensor.meta["group_size"]
        return narrow_inputs(qtensor, start, size, {"weight_packed": 8, "weight_scale": group,
                                                    "weight_zero_point": group})

    def check(self, qtensor: QuantizedTensor) -> None:
        n, k = qtensor.shape
        group = qtensor.meta.get("group_size")
        if not isinstance(group, int) or group <= 0 or k % group or group % 8:
            raise ValueError(f"group size {group!r} does not split {k} input features into whole words")
        require_tensor(qtensor, "weight_packed", (n, k // 8), torch.int32)
        require_tensor(qtensor, "weight_scale", (n, k // group), torch.float32)
        if require_tensor(qtensor, "weight_zero_point", (n, k // group), torch.uint8).max() > _MAXQ:
            raise ValueError(f"zero points above {_MAXQ}")

    def linear(self, x: torch.Tensor, qtensor: QuantizedTensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        t, group = qtensor.tensors, qtensor.meta["group_size"]
        if x.is_cuda:
            if not quant_reference.HAS_TRITON:
                return super().linear(x, qtensor, bias)
            from rtx_kernels.quant_matmul import int4_linear

            return int4_linear(x, t["weight_packed"], t["weight_scale"], t["weight_zero_point"], group, bias)
        return quant_reference.int4_linear_cpu(x, t["weight_packed"], t["weight_scale"], t["weight_zero_point"],
                                               group, bias)


class Int4Group64Quantizer(Int4Quantizer):
    name = "int4-g64"
    group_size = 64


class Int4Group32Quantizer(Int4Quantizer):
    # Groups of 32 Gaussian values span about 4.1 standard deviations: a step of 0.27 sd, 0.08 of the weight.
    max_relative_error = 0.1
    name = "int4-g32"
    group_size = 32


class Int4GPTQQuantizer(Int4Quantizer):
    """The same format, with each column's rounding error pushed onto the columns not yet rounded, weighted by how
    the layer's inputs correlate on calibration text (GPTQ): the output error shrinks, not the weight error."""

    calibrated = True
    name = "int4-gptq"
    # Columns by decreasing input energy, groups fixed from the original weights (gptq_solver).
    act_order = True

    @classmethod
    def describe(cls) -> dict[str, object]:
        return {"description": "int4 weights, asymmetric groups of 128, GPTQ-calibrated with act-order and static "
                               "groups (plain rounding without calibration data)", "bits": 4}

    def _solve(self, w: torch.Tensor, group: int, stats: LayerStats | None):
        if stats is None:
            return super()._solve(w, group, stats)
        return gptq_quantize(w, stats.hessian.to(w.device), group, minmax_group_params, maxq=_MAXQ,
                             act_order=self.act_order)


@hookimpl
def register_quantizers(register) -> None:
    register("int4", Int4Quantizer)
    register("int4-g64", Int4Group64Quantizer)
    register("int4-g32", Int4Group32Quantizer)
    register("int4-gptq", Int4GPTQQuantizer)
