"""int8 weights and activations, SmoothQuant-style (W8A8): "int8-sq".

A few input channels of a layer's activations run far larger than the rest, and a per-token int8 scale set by them
leaves every other channel a handful of levels. Calibration measures each input channel's largest ``|x_j|``; the
layer divides its input by ``s_j = |x_j|max ** ALPHA`` (scaled to a geometric mean of 1) and multiplies the weight's
column j by the same, which leaves the product as it was and moves half of each channel's range (in log terms) from
the activations into the weights. Weights are then int8 with one scale per output channel; activations int8 with
one scale per token, quantized when the layer runs.

SmoothQuant proper also weighs each weight column's range into ``s`` (over all of q|k|v for a fused input). Here
``s`` comes from the activations alone: ``quantize`` sees one layer at a time, and layers fused along their outputs
(q|k|v, gate|up) read one input and must share one ``s``. It is kept within [1/10, 10]: a channel calibration saw
almost silent would otherwise be multiplied up a hundredfold or more when it does carry values, and set every token's
scale. Without calibration statistics (quantized as a model loads), ``s`` is 1.

On a GPU whose build of torch runs ``torch._int_mm`` correctly (tried once) and whose layer sizes it takes, the
product is an int8 matrix multiply with int32 sums; elsewhere the same integers are multiplied in float32, which is
exact while a sum stays below 2^24 and within float32's rounding beyond (on the CPU ``_int_mm`` is far slower). On a
GPU one Triton kernel divides and rounds the activations (``rtx_kernels.quant_rows``, the same bits as here).

Products of at most ``WEIGHT_ONLY_MAX_ROWS`` rows on a GPU (decode steps of a few requests) skip rounding the
activations: reading the weight bounds them, so int8 activations would save nothing, while padding them to
``_int_mm``'s 17 rows and the extra kernels cost more than the product. They run the int8 weights through the
weight-only GEMV (``rtx_kernels.quant_fma_gemv``) on the smoothed activations as they are, which is also closer to the
unquantized layer. So on a GPU a layer's rounding depends on how many rows it gets at once: a request's tokens can
differ in their last bits between a step of 8 rows and one of 9.
"""

from __future__ import annotations

import functools

import torch

from rtx_kernels import quant_reference
from rtx_plugins.quantizers.int8 import Int8Quantizer
from rtxcore.contracts.quantizer import LayerStats, QuantizedTensor, Quantizer, narrow_inputs, require_tensor
from rtxcore.hookspecs import hookimpl

ALPHA = 0.5
_SMOOTHING_RANGE = (0.1, 10.0)
_LEVELS = 127
# torch._int_mm on CUDA wants more than 16 rows of x and both matrices' sizes in multiples of 8.
_INT_MM_MIN_ROWS = 17
_INT_MM_ALIGN = 8
# The W8A16 GEMV's limit (rtx_kernels.quant_fma_gemv.MAX_M): past it int8_linear takes a GEMM.
WEIGHT_ONLY_MAX_ROWS = 8


@functools.cache
def _int8_matmul_works(device_index: int) -> bool:
    """Whether ``torch._int_mm`` runs on this GPU and gets a small product right: which builds of torch support it
    where changes between releases."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randint(-_LEVELS, _LEVELS + 1, (_INT_MM_MIN_ROWS, 32), generator=gen, dtype=torch.int8)
    w = torch.randint(-_LEVELS, _LEVELS + 1, (16, 32), generator=gen, dtype=torch.int8)
    try:
        got = int_products(x.to(f"cuda:{device_index}"), w.to(f"cuda:{device_index}"), True).cpu()
    except RuntimeError:
        return False
    return torch.equal(got, (x.long() @ w.long().t()).float())


def int_products(xq: torch.Tensor, weight: torch.Tensor, int_mm: bool) -> torch.Tensor:
    """``xq @ weight.T`` of int8 [M, K] and [N, K] as float32: by ``torch._int_mm`` (int32 sums; x padded to the rows
    it wants) or by float32 products of the same integers."""
    if not int_mm:
        return xq.float() @ weight.float().t()
    rows = xq.shape[0]
    if rows < _INT_MM_MIN_ROWS:
        xq = torch.cat([xq, xq.new_zeros(_INT_MM_MIN_ROWS - rows, xq.shape[1])])
    return torch._int_mm(xq, weight.t())[:rows].float()


def smoothing(stats: LayerStats | None, in_features: int) -> torch.Tensor:
    """The divisor of each input channel, float32 [in_features]: ``|x_j|max ** ALPHA`` at a geometric mean of 1, kept
    within ``_SMOOTHING_RANGE``."""
    if stats is None or stats.abs_max.numel() != in_features:
        return torch.ones(in_features)
    s = stats.abs_max.float().clamp_min(1e-12).pow(ALPHA)
    return (s / s.log().mean().exp()).clamp(*_SMOOTHING_RANGE)


def quantize_rows_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row of float32 ``x`` as int8 with its own symmetric scale: (int8 values, float32 scales [rows, 1])."""
    scale = x.abs().amax(dim=-1, keepdim=True).clamp_min(1e-12) * (1.0 / _LEVELS)
    return (x / scale).round().clamp(-_LEVELS, _LEVELS).to(torch.int8), scale


class Int8SmoothQuantizer(Quantizer):
    # The weights alone are int8 per output channel after the columns are smoothed; on Gaussian weights with no
    # statistics (s = 1) that is int8's own error.
    max_relative_error = Int8Quantizer.max_relative_error
    calibrated = True
    uses_hessian = False  # the per-channel maxima are enough
    # Activations are rounded too: per token, int8 leaves about twice int8-weights' error, and outlier channels
    # that smoothing cannot tame cost more.
    layer_error_budget = 0.06
    fallback = "int8"

    @classmethod
    def describe(cls) -> dict[str, object]:
        return {"description": "int8 weights (per output channel) and activations (dynamic, per token), with "
                               "SmoothQuant-style smoothing of the activations' channels from calibration", "bits": 8}

    def quantize(self, weight: torch.Tensor, stats: LayerStats | None = None) -> QuantizedTensor:
        s = smoothing(stats, weight.shape[1]).to(weight.device)
        smoothed = Int8Quantizer().quantize(weight.float() * s[None, :])
        return QuantizedTensor("int8-sq", {**smoothed.tensors, "input_smooth": s}, tuple(weight.shape), weight.dtype,
                               {"bits": 8, "strategy": "channel", "activations": "dynamic-token-int8",
                                "smoothing_alpha": ALPHA})

    def dequantize(self, qtensor: QuantizedTensor) -> torch.Tensor:
        t = qtensor.tensors
        return (t["weight"].float() * t["weight_scale"][:, None] / t["input_smooth"][None, :]).to(qtensor.dtype)

    def slice_inputs(self, qtensor: QuantizedTensor, start: int, size: int) -> QuantizedTensor:
        # The smoothing divides each input feature: its share goes with the columns.
        return narrow_inputs(qtensor, start, size, {"weight": 1, "input_smooth": 1})

    def check(self, qtensor: QuantizedTensor) -> None:
        n, k = qtensor.shape
        require_tensor(qtensor, "weight", (n, k), torch.int8)
        require_tensor(qtensor, "weight_scale", (n,), torch.float32)
        s = require_tensor(qtensor, "input_smooth", (k,), torch.float32)
        if not (s > 0).all():
            raise ValueError("'input_smooth' holds values that are not positive")

    def linear(self, x: torch.Tensor, qtensor: QuantizedTensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        t = qtensor.tensors
        on_gpu = x.is_cuda and quant_reference.HAS_TRITON
        if on_gpu and x.shape[0] <= WEIGHT_ONLY_MAX_ROWS:
            from rtx_kernels.quant_matmul import int8_linear

            # x / s is float32 (type promotion): one kernel, and the smoothed values unrounded.
            return int8_linear(x / t["input_smooth"], t["weight"], t["weight_scale"], bias).to(x.dtype)
        if on_gpu:
            from rtx_kernels.quant_rows import quantize_rows_int8 as quantize_on_gpu

            xq, x_scale = quantize_on_gpu(x, t["input_smooth"])
        else:
            xq, x_scale = quantize_rows_int8(x.float() / t["input_smooth"])
        n, k = t["weight"].shape
        int_mm = (x.is_cuda and n % _INT_MM_ALIGN == 0 and k % _INT_MM_ALIGN == 0
                  and _int8_matmul_works(x.device.index or 0))
        y = int_products(xq, t["weight"], int_mm) * x_scale * t["weight_scale"][None, :]
        if bias is not None:
            y = y + bias.float()
        return y.to(x.dtype)


@hookimpl
def register_quantizers(register) -> None:
    register("int8-sq", Int8SmoothQuantizer)
