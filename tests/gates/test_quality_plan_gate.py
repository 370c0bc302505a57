"""The quality gate's planned check catches a planner that does not plan: left with every layer group in int4, the
default model's held-out perplexity rises far past the seed's 0.5 and the check fails. (`rtx gates` in CI runs the
real planner through the same check, with the gate's full settings, and holds it to 0.5.)"""

from __future__ import annotations

import pytest

from rtxcore.gates import quality
from rtxcore.gates.outcome import FAIL
from rtxcore.quant import planner
from rtxcore.registry import load_plugins

pytestmark = pytest.mark.model


def _settings() -> quality.QualitySettings:
    return quality.QualitySettings(quantizers=[], planned=["int4"], plan_ppl_delta=0.5, planned_max_ppl_increase=0.5,
                                   plan_calibration_tokens=512)


def test_a_planner_that_moves_nothing_fails_the_planned_check(monkeypatch):
    def first_step_only(groups, evaluate, ppl_float, budget, log=lambda line: None):
        step = planner.PlanStep(evaluate(groups), sum(g.format.nbytes for g in groups), [])
        return planner.Plan(groups, ppl_float, budget, [step])

    monkeypatch.setattr(planner, "search", first_step_only)
    check = quality._planned_check(_settings(), "int4", 256, load_plugins())
    assert check.verdict == FAIL and check.figure is not None and check.figure > 1.0, check
    assert "int4 " in check.detail and "float" not in check.detail, check.detail

