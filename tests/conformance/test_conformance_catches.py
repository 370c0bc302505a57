"""Deliberately wrong plugins are each caught by the conformance suite, with a message naming the broken rule."""

from __future__ import annotations

import pytest
import torch

from rtx_conformance.plugin import Selection
from rtx_conformance.report import render_table, summarize
from rtx_conformance.runner import run_suite
from rtx_plugins.quantizers import int8
from rtxcore.registry import load_plugins
from tests.helpers.conformance_plugins import WrongPlugins


@pytest.fixture(scope="module")
def wrong_run():
    registry = load_plugins(load_entrypoints=False, extra=[("wrong", WrongPlugins()), ("int8", int8)])
    return run_suite(registry, Selection())


def _failures(run, kind: str, name: str) -> list[str]:
    return [r.message for r in run.session.results if (r.kind, r.name) == (kind, name) and r.outcome == "failed"]


@pytest.mark.parametrize("kind, name, rule, detail", [
    ("sampler", "leaky-top-k", "[sampler.allowed_set]", "outside the"),
    ("eviction_policy", "hit-evicting", "[eviction.only_candidates]", "which is in use"),
    ("scheduler", "over-budget", "[scheduler.token_budget]", "budget is"),
    ("quantizer", "int4-overpromising", "[quantizer.error_bound]", "exceeds the declared 0.01"),
    ("quantizer", "int8-unrounded-qat", "[quantizer.fake_quantize]", "differs from dequantize(quantize())"),
    ("quantizer", "fp8-scale-dropping", "[quantizer.rounded_rows]", "given them rounded (fp8-e4m3-rows) differs"),
])
def test_wrong_plugin_is_caught_naming_the_rule(wrong_run, kind, name, rule, detail):
    failures = _failures(wrong_run, kind, name)
    assert failures, f"{kind} {name} passed the suite"
    assert any(rule in m and detail in m for m in failures), failures


def test_the_run_fails_and_the_table_says_why(wrong_run):
    assert not wrong_run.passed
    table = render_table(summarize(wrong_run.session))
    # Each failure line starts with the rule it broke (not the test that found it).
    assert "FAILED sampler leaky-top-k: [sampler.allowed_set]" in table
    assert "FAILED scheduler over-budget" in table and "[scheduler.token_budget]" in table


def test_builtin_int8_quantizer_passes_its_contract(wrong_run):
    results = [r for r in wrong_run.session.results if r.name == "int8"]
    assert results and all(r.outcome == "passed" for r in results), [(r.check, r.message) for r in results]
    assert {r.check for r in results} >= {"declared_bound", "error_bound", "shape", "round_trip", "linear", "fusable",
                                          "fake_quantize", "rounded_rows"}


def test_linear_from_rounded_rows_is_checked_where_a_form_is_named():
    """The right fp8 taking rounded rows on the CPU passes the check, each of the three row counts checked."""
    from rtx_conformance.checks.quantizer import check_rounded_rows
    from tests.helpers.conformance_plugins import RoundedRowsFP8Quantizer

    weight = torch.randn(128, 256, generator=torch.Generator().manual_seed(0)) * 0.02
    assert check_rounded_rows(RoundedRowsFP8Quantizer(), weight, seed=1) == 3
