"""The quality gate's planned check catches a planner that does not plan: left with every layer group in int4, the
default model's held-out perplexity rises far past the seed's 0.5 and the check fails. (`rtx gates` in CI runs the
real planner through the same check, with the gate's full settings, and holds it to 0.5.)"""

from __future__ import annotations

import pytest

from rtxcore.gates import quality
from rtxcore.gates.outcome import FAIL, PASS
from rtxcore.quant import planner
from rtxcore.registry import load_plugins

pytestmark = pytest.mark.model


def _settings() -> quality.QualitySettings:
    return quality.QualitySettings(quantizers=[], planned=["int4"], plan_ppl_delta=0.5, planned_max_ppl_increase=0.5,
                                   plan_calibration_tokens=512, plan_eval_tokens=256)


def test_a_planner_that_moves_nothing_fails_the_planned_check(monkeypatch):
    def first_step_only(groups, evaluate, ppl_float, budget, log=lambda line: None, cost_basis="weight bytes",
                        confidence=0.5):
        result = evaluate(groups)
        step = planner.PlanStep(result.ppl, result.bound, sum(g.format.nbytes for g in groups), [])
        return planner.Plan(groups, ppl_float, budget, [step], cost_basis, confidence)

    monkeypatch.setattr(planner, "search", first_step_only)
    check = quality._planned_check(_settings(), "int4", 256, load_plugins(), {})
    assert check.verdict == FAIL and check.figure is not None and check.figure > 1.0, check
    assert "int4 " in check.detail and "float" not in check.detail, check.detail



def test_a_plan_that_fails_is_one_failed_check_and_the_others_still_run(monkeypatch):
    calls = []

    def failing_for_fp8(settings, method, eval_tokens, registry, calibrations):
        calls.append(method)
        if method == "fp8":
            raise RuntimeError("out of memory")
        return quality.Check(quality.GATE, f"{method} planned: perplexity increase", 0.1, 0.5, "<=")

    monkeypatch.setattr(quality, "_planned_check", failing_for_fp8)
    monkeypatch.setattr(quality, "_every_layer_checks", lambda settings, gate, registry, say: [])
    settings = quality.QualitySettings(quantizers=[], planned=["fp8", "int4"], plan_ppl_delta=0.5,
                                       planned_max_ppl_increase=0.5, plan_calibration_tokens=512, plan_eval_tokens=256)
    checks = quality.run(settings, None, lambda line: None)
    assert calls == ["fp8", "int4"]
    assert [(c.name, c.verdict) for c in checks] == [("fp8 planned: ran to the end", FAIL),
                                                     ("int4 planned: perplexity increase", PASS)]
    assert "out of memory" in checks[0].detail
