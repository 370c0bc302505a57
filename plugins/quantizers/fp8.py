"""fp8 e4m3: weights with one scale per output channel, activations quantized per token when the layer runs (W8A8).

On a GPU with fp8 tensor cores (compute capability 8.9 and up) the product runs in fp8 through ``torch._scaled_mm``
with row-wise scales (its fast accumulation unless ``RTX_FP8_FAST_ACCUM=0``); elsewhere the same rounding of weights
and activations is applied and the product runs in the activations' dtype, so CPU results show the method's real
accuracy.

On a GPU, products of up to 8 rows (decode steps of a few requests) leave the activations unrounded: the Triton GEMV
(``rtx_kernels.gemv``) reads the fp8 weight a byte a weight and applies the row scales in its epilogue. Decode is bound
by reading the weight, so rounding the activations there would save nothing, while ``_scaled_mm`` pads those rows to
its tiles and costs more than bf16 (docs/benchmarks.md). As with int8-sq, a layer's rounding then depends on how many
rows it gets at once: a request's tokens can differ in their last bits between a step of 8 rows and one of 9.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from rtx_kernels import quant_reference
from rtxcore import envs
from rtxcore.contracts.quantizer import (
    FP8_ROWS,
    LayerStats,
    QuantizedTensor,
    Quantizer,
    RoundedRows,
    RowRounding,
    narrow_inputs,
    require_tensor,
    round_rows,
)
from rtxcore.hookspecs import hookimpl

FP8 = torch.float8_e4m3fn
# _scaled_mm wants both matrices' inner and outer sizes in multiples of 16.
_MM_ALIGN = 16
# The GEMV's rows per launch (rtx_kernels.gemv); past it the product is a GEMM on the fp8 tensor cores.
WEIGHT_ONLY_MAX_ROWS = 8


@functools.cache
def _fp8_matmul_works(device_index: int) -> bool:
    """Whether row-wise scaled fp8 matmul runs on this GPU: tried once on a tiny product, since which builds of torch
    and cuBLAS support it on which architectures changes between releases (and 12.x consumer GPUs lack it)."""
    if torch.cuda.get_device_capability(device_index) < (8, 9):
        return False
    a = torch.zeros(16, 16, device=f"cuda:{device_index}").to(FP8)
    one = torch.ones(16, 1, device=a.device)
    try:
        torch._scaled_mm(a, a.t(), scale_a=one, scale_b=one.t(), out_dtype=torch.bfloat16)
    except RuntimeError:
        return False
    return True


@functools.cache
def _fast_accumulation() -> bool:
    # RTX_FP8_FAST_ACCUM, read once per process (a per-call path).
    return envs.RTX_FP8_FAST_ACCUM.get()


@functools.cache
def _triton_reads_fp8(device_index: int) -> bool:
    """Triton loads float8 e4m3 only on compute capability 8.9 and up; older GPUs rebuild the weight instead."""
    return torch.cuda.get_device_capability(device_index) >= (8, 9)


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row of ``x`` scaled so that its largest magnitude becomes fp8's largest: (fp8 values, fp32 scales [rows,
    1])."""
    rows = round_rows(x, FP8_ROWS)
    return rows.values, rows.scale


def _quantize_rows_on_gpu(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`quantize_rows`, the same bits, in one Triton kernel rather than torch's eight per layer."""
    if not quant_reference.HAS_TRITON:
        return quantize_rows(x)
    from rtx_kernels.quant_rows import quantize_rows_fp8

    return quantize_rows_fp8(x)


class FP8Quantizer(Quantizer):
    # e4m3 keeps 3 mantissa bits: relative rounding error up to 2^-4 per value, about 2^-4 / sqrt(3) = 0.036 on
    # average; values far below a row's maximum lose more (subnormals).
    max_relative_error = 0.045
    layer_error_budget = 0.06
    fallback = "int8"

    @classmethod
    def describe(cls) -> dict[str, object]:
        return {"description": "fp8 e4m3 weights (per-channel scales) and activations (dynamic, per token); fp8 "
                               "matrix multiply on GPUs that have it", "bits": 8}

    def quantize(self, weight: torch.Tensor, stats: LayerStats | None = None) -> QuantizedTensor:
        values, scale = quantize_rows(weight)
        return QuantizedTensor("fp8", {"weight": values, "weight_scale": scale.reshape(-1)}, tuple(weight.shape),
                               weight.dtype, {"bits": 8, "strategy": "channel", "activations": "dynamic-token"})

    def dequantize(self, qtensor: QuantizedTensor) -> torch.Tensor:
        t = qtensor.tensors
        return (t["weight"].float() * t["weight_scale"][:, None]).to(qtensor.dtype)

    def slice_inputs(self, qtensor: QuantizedTensor, start: int, size: int) -> QuantizedTensor:
        # Per-channel weight scales stay whole; activations are scaled per token over whatever columns arrive.
        return narrow_inputs(qtensor, start, size, {"weight": 1})

    def check(self, qtensor: QuantizedTensor) -> None:
        n, k = qtensor.shape
        require_tensor(qtensor, "weight", (n, k), FP8)
        require_tensor(qtensor, "weight_scale", (n,), torch.float32)

    def fake_quantize_input(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            xq, scale = quantize_rows(x.detach())
            rounded = (xq.float() * scale).to(x.dtype)
        return x + (rounded - x).detach()

    def rounded_rows(self, qtensor: QuantizedTensor, num_rows: int, device: torch.device) -> RowRounding | None:
        # Only where linear rounds on the GPU and multiplies in fp8: the weight-only GEMV reads its few rows
        # unrounded, and the CPU has no fused kernel to round them.
        return FP8_ROWS if self._fp8_product(qtensor, num_rows, device) else None

    def _weight_only(self, num_rows: int, device: torch.device) -> bool:
        return (device.type == "cuda" and quant_reference.HAS_TRITON and num_rows <= WEIGHT_ONLY_MAX_ROWS
                and _triton_reads_fp8(device.index or 0))

    def _fp8_product(self, qtensor: QuantizedTensor, num_rows: int, device: torch.device) -> bool:
        n, k = qtensor.tensors["weight"].shape
        return (device.type == "cuda" and not self._weight_only(num_rows, device) and n % _MM_ALIGN == 0
                and k % _MM_ALIGN == 0 and _fp8_matmul_works(device.index or 0))

    def linear(self, x: torch.Tensor | RoundedRows, qtensor: QuantizedTensor,
               bias: torch.Tensor | None = None) -> torch.Tensor:
        t = qtensor.tensors
        if isinstance(x, RoundedRows):
            if x.form is not FP8_ROWS:
                raise ValueError(f"fp8 layers take {FP8_ROWS.value} rows, not {x.form.value}")
            xq, x_scale, dtype = x.values, x.scale, x.dtype
            on_tensor_cores = self._fp8_product(qtensor, xq.shape[0], xq.device)
        else:
            rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
            if x.dim() == 2 and self._weight_only(rows, x.device):
                from rtx_kernels.gemv import gemv

                return gemv(x, t["weight"], bias, weight_scale=t["weight_scale"])
            on_tensor_cores = x.dim() == 2 and self._fp8_product(qtensor, rows, x.device)
            xq, x_scale = _quantize_rows_on_gpu(x) if on_tensor_cores else quantize_rows(x)
            dtype = x.dtype
        if on_tensor_cores:
            if quant_reference.HAS_TRITON:
                from rtx_kernels import fp8_matmul

                if fp8_matmul.applies(xq):  # up to 64 rows on Hopper, where turned on: smaller tiles than cuBLAS
                    return fp8_matmul.fp8_matmul(xq, x_scale, t["weight"], t["weight_scale"], bias).to(dtype)
            # Row-wise scaling has a bf16 output on every architecture that supports it; the weight's transpose is
            # the column-major operand it wants.
            y = torch._scaled_mm(xq, t["weight"].t(), scale_a=x_scale, scale_b=t["weight_scale"][None, :],
                                 out_dtype=torch.bfloat16, bias=None if bias is None else bias.to(torch.bfloat16),
                                 use_fast_accum=_fast_accumulation())
            return y.to(dtype)
        x_approx = (xq.float() * x_scale).to(dtype)
        return F.linear(x_approx, self.dequantize(qtensor).to(dtype), bias)


@hookimpl
def register_quantizers(register) -> None:
    register("fp8", FP8Quantizer)
