"""The fused per-token quantization of activations equals the quantizers' torch rounding bit for bit: fp8's, and
int8-sq's with its smoothing divisor."""

from __future__ import annotations

import pytest
import torch

from rtx_kernels.quant_rows import FP8, FP8_MAX, quantize_rows_fp8, quantize_rows_int8
from rtx_plugins.quantizers import int8_sq
from rtx_plugins.quantizers.fp8 import quantize_rows
from tests.helpers.triton import DEVICE, generator


def _assert_same(x: torch.Tensor) -> None:
    q, scale = quantize_rows_fp8(x)
    q_ref, scale_ref = quantize_rows(x)
    assert q.dtype == FP8 and scale.shape == (x.shape[0], 1)
    assert torch.equal(scale, scale_ref)
    diff = (q.view(torch.uint8) != q_ref.view(torch.uint8)).nonzero()
    assert diff.numel() == 0, f"{len(diff)} values differ, first at {diff[0].tolist()}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
# 3000 in one tile of the whole row; 17000 past the one-tile limit (16384), in tiles read twice.
@pytest.mark.parametrize("k", [1, 77, 3000, 17000])
def test_matches_the_quantizers_rounding(k, dtype):
    gen = generator(k)
    # Rows from 1e-3 to 1e3 in magnitude, one all zero, and rows strided as views into a wider activation.
    wide = torch.randn(6, k + 5, generator=gen, device=DEVICE) * torch.logspace(-3, 3, 6, device=DEVICE)[:, None]
    wide[3] = 0
    x = wide.to(dtype)[:, :k]
    assert x.stride(0) == k + 5
    _assert_same(x)


def test_many_rows_scales_match():
    """A thousand row maxima, each times 1/448 in float32, the same bits on both sides (a thousand, not more: on the
    CPU each row is one program of Triton's interpreter)."""
    gen = generator(1)
    x = torch.randn(1024, 8, generator=gen, device=DEVICE) * torch.rand(1024, 1, generator=gen, device=DEVICE) * 1e3
    _assert_same(x)


def test_every_e4m3_value_and_the_ties_between_them():
    """Rows whose maximum is 448 have a scale of exactly 1, so each value is rounded as it is: every finite e4m3
    value, the midpoints between neighbours (ties go to the even one), and a hair either side of each midpoint."""
    values = torch.arange(256, dtype=torch.uint8).view(FP8).float()
    values = values[values.isfinite() & (values >= 0)].unique()
    mids = (values[1:] + values[:-1]) / 2
    eps = mids * 2.0**-20
    probe = torch.cat([values, mids, mids - eps, mids + eps, torch.tensor([2.0**-10, 2.0**-12, 1e-30])])
    probe = torch.cat([probe, -probe]).to(DEVICE)
    x = torch.cat([torch.full((1,), FP8_MAX, device=DEVICE), probe])[None, :]
    _assert_same(x)
    q, _ = quantize_rows_fp8(x)
    assert torch.equal(q.view(torch.uint8)[0, 1:], probe.to(FP8).view(torch.uint8))


def test_rejects_what_it_cannot_quantize():
    with pytest.raises(ValueError, match="must be"):
        quantize_rows_fp8(torch.zeros(3, 4, 5, device=DEVICE))
    with pytest.raises(ValueError, match="must be"):
        quantize_rows_fp8(torch.zeros(3, 4, dtype=torch.int32, device=DEVICE))


# --- int8, as int8-sq quantizes its activations -------------------------------------------------------------------


def _assert_same_int8(x: torch.Tensor, divisor: torch.Tensor | None) -> None:
    q, scale = quantize_rows_int8(x, divisor)
    q_ref, scale_ref = int8_sq.quantize_rows_int8(x.float() / divisor if divisor is not None else x.float())
    assert q.dtype == torch.int8 and scale.shape == (x.shape[0], 1)
    assert torch.equal(scale, scale_ref)
    diff = (q != q_ref).nonzero()
    assert diff.numel() == 0, f"{len(diff)} values differ, first at {diff[0].tolist()}"


@pytest.mark.parametrize("smoothed", [True, False], ids=["smoothed", "plain"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("k", [1, 77, 3000, 17000])
def test_int8_matches_int8_sq_rounding(k, dtype, smoothed):
    gen = generator(k + 1)
    wide = torch.randn(6, k + 5, generator=gen, device=DEVICE) * torch.logspace(-3, 3, 6, device=DEVICE)[:, None]
    wide[3] = 0
    x = wide.to(dtype)[:, :k]
    divisor = (torch.rand(k, generator=gen, device=DEVICE) * 9.9 + 0.1) if smoothed else None
    _assert_same_int8(x, divisor)


def test_int8_ties_round_to_even():
    """A row whose maximum is 127 has a scale of exactly 1: halves go to the even integer, a hair off them does not."""
    halves = torch.tensor([0.5, 1.5, 2.5, 125.5, 126.5, 126.5 + 2**-16, 2.5 - 2**-20], device=DEVICE)
    x = torch.cat([torch.tensor([127.0], device=DEVICE), halves, -halves])[None, :]
    _assert_same_int8(x, None)
    q, scale = quantize_rows_int8(x)
    assert scale.item() == 1.0
    expected = torch.tensor([0, 2, 2, 126, 126, 127, 2], device=DEVICE)
    assert torch.equal(q[0, 1:].long(), torch.cat([expected, -expected]))


def test_int8_rejects_a_divisor_of_the_wrong_shape():
    with pytest.raises(ValueError, match="divisor"):
        quantize_rows_int8(torch.zeros(2, 8, device=DEVICE), torch.ones(7, device=DEVICE))


@pytest.mark.parametrize("fmt", ["fp8", "int8"])
def test_a_row_holding_nan_gets_a_nan_scale(fmt):
    """As torch's row maximum is NaN, so the layer's output shows the NaN; the other rows are untouched."""
    gen = generator(9)
    x = torch.randn(3, 300, generator=gen, device=DEVICE)
    x[1, 257] = float("nan")
    if fmt == "fp8":
        (q, scale), (q_ref, scale_ref) = quantize_rows_fp8(x), quantize_rows(x)
        q, q_ref = q.view(torch.uint8), q_ref.view(torch.uint8)
    else:
        (q, scale), (q_ref, scale_ref) = quantize_rows_int8(x), int8_sq.quantize_rows_int8(x)
    assert scale[1].isnan().all() and scale_ref[1].isnan().all()
    assert torch.equal(scale[[0, 2]], scale_ref[[0, 2]]) and torch.equal(q[[0, 2]], q_ref[[0, 2]])


def test_kernel_globals_equal_themselves():
    """A compiled Triton kernel refuses to launch when a global it read differs from the value it was compiled
    with, compared by ``==``: a NaN constexpr (NaN != NaN) stops every launch on a GPU, which the interpreter never
    sees. Every module-level constexpr of the kernels must therefore equal itself."""
    import importlib
    import pkgutil

    import triton.language as tl

    import rtx_kernels

    for info in pkgutil.iter_modules(rtx_kernels.__path__):
        module = importlib.import_module(f"rtx_kernels.{info.name}")
        for name, value in vars(module).items():
            if isinstance(value, tl.constexpr):
                assert value.value == value.value, f"rtx_kernels.{info.name}.{name} = {value.value!r}"
