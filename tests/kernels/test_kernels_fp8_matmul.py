"""The Triton fp8 GEMM equals the product of the rounded operands with their scales, rounded once to bfloat16, and
on a GPU agrees with ``torch._scaled_mm`` (the path it replaces up to 64 rows)."""

from __future__ import annotations

import pytest
import torch

from rtx_kernels.fp8_matmul import fp8_matmul
from rtx_kernels.quant_rows import quantize_rows_fp8
from rtx_plugins.quantizers import fp8 as fp8_plugin
from tests.helpers.triton import DEVICE, ON_GPU, generator

FP8 = torch.float8_e4m3fn


def _operands(m: int, n: int, k: int, seed: int):
    gen = generator(seed)
    x = (torch.randn(m, k, generator=gen, device=DEVICE) * 40).clamp(-448, 448).to(FP8)
    w = (torch.randn(n, k, generator=gen, device=DEVICE) * 40).clamp(-448, 448).to(FP8)
    x_scale = torch.rand(m, 1, generator=gen, device=DEVICE) * 1e-2 + 1e-3
    w_scale = torch.rand(n, generator=gen, device=DEVICE) * 1e-2 + 1e-3
    return x, x_scale, w, w_scale


# One rounding to bfloat16: half an ulp (2^-8 relative) on the GPU; the interpreter truncates instead (a whole ulp).
RTOL = 2**-8 if ON_GPU else 2**-7


def _reference(x, x_scale, w, w_scale, bias=None):
    y = (x.double() @ w.double().t()) * x_scale.double() * w_scale.double()[None, :]
    return y if bias is None else y + bias.double()


# Shapes: rows within and beyond MAX_ROWS (64; the kernel takes any), an output wider than 16,384 (gate|up), and a
# K that is not a multiple of the K step (the masked loop). Small in the interpreter.
SHAPES = ([(32, 4096, 4096), (200, 6144, 4096), (256, 28672, 4096), (130, 4096, 14336), (64, 4096, 4000)]
          if ON_GPU else [(5, 64, 256), (130, 48, 512), (20, 16400, 128), (3, 32, 300)])


@pytest.mark.parametrize("m,n,k", SHAPES)
def test_product_of_the_rounded_operands(m, n, k):
    x, x_scale, w, w_scale = _operands(m, n, k, seed=m + n + k)

    out = fp8_matmul(x, x_scale, w, w_scale)

    ref = _reference(x, x_scale, w, w_scale)
    assert out.dtype == torch.bfloat16 and out.shape == (m, n)
    # Partial sums promoted to float32 every 128 products (without: an output 1.5% off at K = 14,336 on an H100; only
    # the GPU run can see that, the interpreter multiplies in float32), in another order than float64: a few float32
    # ulps of the sum, then one bf16 rounding.
    torch.testing.assert_close(out.double(), ref, rtol=RTOL, atol=1e-3 * ref.abs().max().item())


def test_bias_is_added_before_the_rounding():
    x, x_scale, w, w_scale = _operands(7, 64, 256, seed=3)
    bias = torch.randn(64, generator=generator(4), device=DEVICE).to(torch.bfloat16) * 10

    out = fp8_matmul(x, x_scale, w, w_scale, bias)

    ref = _reference(x, x_scale, w, w_scale, bias)
    torch.testing.assert_close(out.double(), ref, rtol=RTOL, atol=1e-3 * ref.abs().max().item())


def test_rejects_operands_that_are_not_e4m3():
    x, x_scale, w, w_scale = _operands(4, 32, 128, seed=5)
    with pytest.raises(ValueError, match="e4m3"):
        fp8_matmul(x.float(), x_scale, w, w_scale)
    with pytest.raises(ValueError, match="e4m3"):
        fp8_matmul(x, x_scale, w[:, :64], w_scale)


@pytest.mark.skipif(not ON_GPU, reason="torch._scaled_mm needs an fp8 GPU")
@pytest.mark.parametrize("m", [9, 64, 256])
def test_agrees_with_scaled_mm(m):
    x, x_scale, w, w_scale = _operands(m, 4096, 4096, seed=m)

    out = fp8_matmul(x, x_scale, w, w_scale)

    ref = torch._scaled_mm(x, w.t(), scale_a=x_scale, scale_b=w_scale[None, :], out_dtype=torch.bfloat16)
    torch.testing.assert_close(out.float(), ref.float(), rtol=2**-7, atol=1e-3 * ref.float().abs().max().item())


@pytest.fixture
def fast_accumulation_switch(monkeypatch):
    """Sets RTX_FP8_FAST_ACCUM for the fp8 quantizer, which reads it once per process; read afresh after the test."""
    def set_switch(on: bool) -> None:
        monkeypatch.setenv("RTX_FP8_FAST_ACCUM", "1" if on else "0")
        fp8_plugin._fast_accumulation.cache_clear()
    yield set_switch
    fp8_plugin._fast_accumulation.cache_clear()


# The quantizer's cuBLAS path sits beside the kernel that replaces it at few rows, so that gpu.py's fp8 step runs both.
@pytest.mark.skipif(not ON_GPU or torch.cuda.get_device_capability() < (8, 9),
                    reason="torch._scaled_mm needs fp8 tensor cores")
def test_fp8_quantizer_takes_cublas_fast_accumulation_where_asked(fast_accumulation_switch):
    gen = generator(11)
    weight = torch.randn(4096, 4096, generator=gen, device=DEVICE).bfloat16()
    x = torch.randn(300, 4096, generator=gen, device=DEVICE).bfloat16()  # past the Triton GEMM's rows
    quantizer = fp8_plugin.FP8Quantizer()
    qtensor = quantizer.quantize(weight)
    xq, x_scale = quantize_rows_fp8(x)
    expected = {fast: torch._scaled_mm(xq, qtensor.tensors["weight"].t(), scale_a=x_scale,
                                       scale_b=qtensor.tensors["weight_scale"][None, :], out_dtype=torch.bfloat16,
                                       use_fast_accum=fast) for fast in (False, True)}
    if torch.cuda.get_device_capability()[0] == 9:  # Hopper's fp8 MMA: the two modes differ at this depth
        assert not torch.equal(expected[False], expected[True])
    for fast in (False, True):
        fast_accumulation_switch(fast)
        assert torch.equal(quantizer.linear(x, qtensor), expected[fast])
