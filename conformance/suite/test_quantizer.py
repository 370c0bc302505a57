"""Quantizer contract: declared error bound, running from the stored form, fusing along the outputs, recorded shape,
save and load round trip."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from rtx_conformance.checks.quantizer import (
    SHAPES,
    check_declared_bound,
    check_error_bound,
    check_fake_quantize,
    check_fusable,
    check_linear,
    check_round_trip,
    check_rounded_rows,
    check_shape,
)
from rtx_conformance.rules import build
from rtx_conformance.suite.budgets import SLOW

pytestmark = [pytest.mark.rtx_kind("quantizer"), pytest.mark.rtx_rules("quantizer.builds")]


def new_quantizer(component):
    return build("quantizer", component.cls)


def _gaussian(shape, std: float, seed: int) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * std


@pytest.mark.rtx_rules("quantizer.declares_bound")
def test_declared_bound(component):
    check_declared_bound(new_quantizer(component))


@pytest.mark.rtx_rules("quantizer.error_bound")
@SLOW
@given(shape=st.sampled_from(SHAPES), std=st.sampled_from([0.02, 0.1, 1.0]), seed=st.integers(0, 2**16))
def test_error_bound(component, shape, std, seed):
    check_error_bound(new_quantizer(component), _gaussian(shape, std, seed))


@pytest.mark.rtx_rules("quantizer.linear")
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_linear(component, shape, dtype):
    check_linear(new_quantizer(component), _gaussian(shape, 0.02, 2), seed=3, dtype=dtype)


@pytest.mark.rtx_rules("quantizer.rounded_rows")
def test_rounded_rows(component):
    # A method that names no form here (every built-in on a CPU) holds the rule as stated: nothing is handed to it
    # rounded. Not a skip: the rule is met, and gates count it so.
    check_rounded_rows(new_quantizer(component), _gaussian(SHAPES[1], 0.02, 6), seed=7)


@pytest.mark.rtx_rules("quantizer.fake_quantize")
def test_fake_quantize(component):
    check_fake_quantize(new_quantizer(component), _gaussian(SHAPES[1], 0.02, 5))


@pytest.mark.rtx_rules("quantizer.fusable")
def test_fusable(component):
    check_fusable(new_quantizer(component), _gaussian(SHAPES[1], 0.02, 4))


@pytest.mark.parametrize("shape", SHAPES[:2])
@pytest.mark.rtx_rules("quantizer.shape")
def test_shape(component, shape):
    check_shape(new_quantizer(component), component.name, _gaussian(shape, 0.02, 0))


@pytest.mark.rtx_rules("quantizer.round_trip")
def test_round_trip(component, tmp_path):
    check_round_trip(new_quantizer(component), _gaussian(SHAPES[1], 0.02, 1), tmp_path)
