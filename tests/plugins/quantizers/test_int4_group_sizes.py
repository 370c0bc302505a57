"""int4 in groups of 64 and 32 (int4-g64, int4-g32): the same format with finer scales, less rounding error for more
bytes, run by the same kernels; each passes the quantizer contract of the conformance suite."""

from __future__ import annotations

import pytest
import torch

from rtx_conformance.plugin import Selection
from rtx_conformance.runner import run_suite
from rtxcore.registry import load_plugins


def _nbytes(qt) -> int:
    return sum(t.numel() * t.element_size() for t in qt.tensors.values())


def test_smaller_groups_round_finer_for_more_bytes():
    registry = load_plugins()
    weight = torch.randn(256, 1536, generator=torch.Generator().manual_seed(0))
    errors, sizes = [], []
    for name, group in (("int4", 128), ("int4-g64", 64), ("int4-g32", 32)):
        quantizer = registry.create("quantizer", name)
        qt = quantizer.quantize(weight)
        quantizer.check(qt)
        assert qt.method == name and qt.meta["group_size"] == group
        assert qt.tensors["weight_scale"].shape == (256, 1536 // group)
        errors.append(((quantizer.dequantize(qt).float() - weight).norm() / weight.norm()).item())
        sizes.append(_nbytes(qt))
        assert errors[-1] <= quantizer.max_relative_error
    assert errors[0] > errors[1] > errors[2]
    assert sizes[0] < sizes[1] < sizes[2] < 256 * 1536  # still well under int8's byte a weight


def test_a_narrow_layer_takes_the_largest_group_that_divides_it():
    quantizer = load_plugins().create("quantizer", "int4-g64")
    assert quantizer.quantize(torch.randn(8, 96)).meta["group_size"] == 32


@pytest.mark.parametrize("name", ["int4-g64", "int4-g32"])
def test_the_group_size_variants_pass_the_quantizer_contract(name):
    run = run_suite(load_plugins(), Selection(names=(name,)))
    results = [r for r in run.session.results if r.name == name]
    assert results and all(r.outcome == "passed" for r in results), [(r.check, r.message) for r in results]
