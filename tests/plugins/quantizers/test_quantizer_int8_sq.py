"""The SmoothQuant-style W8A8 quantizer ("int8-sq"): smoothing pays on activations with outlier channels, the layer
equals its integer arithmetic, and fused layers share their smoothing."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from rtx_kernels import quant_reference
from rtx_plugins.quantizers.int8_sq import (
    WEIGHT_ONLY_MAX_ROWS,
    Int8SmoothQuantizer,
    int_products,
    quantize_rows_int8,
    smoothing,
)
from rtxcore.contracts.quantizer import LayerStats, concat_rows

K, N = 256, 96


def _activations(gen: torch.Generator, rows: int = 64) -> torch.Tensor:
    """Rows of x whose channels 3, 70 and 200 run 60 times larger than the rest, as in LLM activations."""
    x = torch.randn(rows, K, generator=gen)
    x[:, [3, 70, 200]] *= 60
    return x


def _stats(x: torch.Tensor) -> LayerStats:
    return LayerStats(torch.zeros(0), x.shape[0], x.abs().amax(dim=0), x)


def _relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got - want).norm() / want.norm()).item()


def test_smoothing_tames_outlier_channels():
    gen = torch.Generator().manual_seed(0)
    x, weight = _activations(gen), torch.randn(N, K, generator=gen) / K**0.5
    calibration, held_out = x[:32], x[32:]
    want = held_out @ weight.t()
    quantizer = Int8SmoothQuantizer()
    plain = quantizer.linear(held_out, quantizer.quantize(weight))
    smoothed = quantizer.linear(held_out, quantizer.quantize(weight, _stats(calibration)))
    # Without smoothing a token's scale is set by its outlier channels and the rest get a few levels.
    assert _relative_error(smoothed, want) < 0.5 * _relative_error(plain, want)
    assert _relative_error(smoothed, want) < 0.02


def test_linear_is_its_integer_arithmetic():
    gen = torch.Generator().manual_seed(1)
    x, weight, bias = _activations(gen, 5), torch.randn(N, K, generator=gen), torch.randn(N, generator=gen)
    quantizer = Int8SmoothQuantizer()
    qt = quantizer.quantize(weight, _stats(x))
    t = qt.tensors
    xq, x_scale = quantize_rows_int8(x / t["input_smooth"])
    sums = xq.long() @ t["weight"].long().t()  # exact integers
    want = sums.double() * x_scale.double() * t["weight_scale"].double()[None, :] + bias.double()
    got = quantizer.linear(x, qt, bias)
    assert got.dtype == x.dtype and _relative_error(got.double(), want) < 1e-6
    # dequantize undoes the smoothing. The weight's own error grows (about 0.03 here, int8 alone about 0.01): that
    # is the range smoothing moved from the activations into the weights.
    assert _relative_error(quantizer.dequantize(qt), weight) < 0.05


@pytest.mark.skipif(not torch.cuda.is_available() or not quant_reference.HAS_TRITON,
                    reason="the GPU's two paths need a GPU and Triton")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("rows", [1, WEIGHT_ONLY_MAX_ROWS, WEIGHT_ONLY_MAX_ROWS + 1, 40])
def test_on_the_gpu(rows, dtype):
    """Up to WEIGHT_ONLY_MAX_ROWS rows: the int8 weights times the smoothed activations, unrounded. Beyond: the
    integer arithmetic above, the activations rounded by the Triton kernel and multiplied by ``torch._int_mm``.
    bfloat16 results are those rounded once more."""
    gen = torch.Generator().manual_seed(6 + rows)
    x, weight, bias = _activations(gen, rows), torch.randn(N, K, generator=gen), torch.randn(N, generator=gen)
    x, bias = x.to(dtype), bias.to(dtype)
    quantizer = Int8SmoothQuantizer()
    qt = quantizer.quantize(weight, _stats(_activations(gen)))
    t = qt.tensors
    if rows <= WEIGHT_ONLY_MAX_ROWS:
        w = t["weight"].double() * t["weight_scale"].double()[:, None]
        want = (x.double() / t["input_smooth"].double()) @ w.t() + bias.double()
    else:
        xq, x_scale = quantize_rows_int8(x / t["input_smooth"])
        sums = xq.long() @ t["weight"].long().t()
        want = sums.double() * x_scale.double() * t["weight_scale"].double()[None, :] + bias.double()
    on_gpu = dataclasses.replace(qt, tensors={name: tensor.cuda() for name, tensor in t.items()})
    got = quantizer.linear(x.cuda(), on_gpu, bias.cuda())
    assert got.dtype == x.dtype and _relative_error(got.double().cpu(), want) < (1e-5 if dtype == torch.float32
                                                                                 else 1e-2)


def test_the_weight_only_path_ends_where_the_gemv_does():
    quant_fma_gemv = pytest.importorskip("rtx_kernels.quant_fma_gemv")
    assert WEIGHT_ONLY_MAX_ROWS == quant_fma_gemv.MAX_M


def test_smoothing_without_statistics_is_one_and_otherwise_has_geometric_mean_one():
    assert torch.equal(smoothing(None, 8), torch.ones(8))
    x = _activations(torch.Generator().manual_seed(2))
    s = smoothing(_stats(x), K)
    assert abs(s.log().mean().item()) < 1e-5 and s[3] > 5 * s[4]


def test_a_channel_silent_in_calibration_is_not_blown_up_later():
    gen = torch.Generator().manual_seed(4)
    x, weight = torch.randn(64, K, generator=gen), torch.randn(N, K, generator=gen) / K**0.5
    x[:32, 7] = 0.0  # silent in calibration, awake afterwards
    quantizer = Int8SmoothQuantizer()
    qt = quantizer.quantize(weight, _stats(x[:32]))
    assert qt.tensors["input_smooth"][7] == pytest.approx(0.1)  # the floor, not 1e-6
    assert _relative_error(quantizer.linear(x[32:], qt), x[32:] @ weight.t()) < 0.05


def test_both_ways_of_multiplying_the_integers_agree():
    gen = torch.Generator().manual_seed(5)
    for rows in (1, 16, 17, 40):  # torch._int_mm wants more than 16 rows: fewer are padded
        xq = torch.randint(-127, 128, (rows, 64), generator=gen, dtype=torch.int8)
        w = torch.randint(-127, 128, (24, 64), generator=gen, dtype=torch.int8)
        exact = (xq.long() @ w.long().t()).float()
        assert torch.equal(int_products(xq, w, int_mm=True), exact)
        assert torch.equal(int_products(xq, w, int_mm=False), exact)


def test_quantize_keeps_the_weight_on_its_device():
    """As a model loads with --quantization, weights are already on the GPU: the smoothing must follow them."""
    qt = Int8SmoothQuantizer().quantize(torch.empty(N, K, device="meta"), _stats(_activations(torch.Generator())))
    assert {t.device.type for t in qt.tensors.values()} == {"meta"}


def test_fused_layers_share_their_smoothing():
    gen = torch.Generator().manual_seed(3)
    stats = _stats(_activations(gen))
    quantizer = Int8SmoothQuantizer()
    q, k = (quantizer.quantize(torch.randn(n, K, generator=gen), stats) for n in (32, 16))
    fused = concat_rows([q, k])
    assert fused.tensors["weight"].shape == (48, K) and torch.equal(fused.tensors["input_smooth"],
                                                                     q.tensors["input_smooth"])
    quantizer.check(fused)
    other = quantizer.quantize(torch.randn(16, K, generator=gen), _stats(_activations(gen)))
    with pytest.raises(ValueError, match="'input_smooth' differ"):
        concat_rows([q, other])


def test_check_names_a_damaged_smoothing():
    quantizer = Int8SmoothQuantizer()
    qt = quantizer.quantize(torch.randn(N, K))
    qt.tensors["input_smooth"] = qt.tensors["input_smooth"][:-1]
    with pytest.raises(ValueError, match="'input_smooth' is"):
        quantizer.check(qt)
    qt.tensors["input_smooth"] = -torch.ones(K)
    with pytest.raises(ValueError, match="not positive"):
        quantizer.check(qt)
