"""The mixed-precision planner: the search moves the groups whose error costs the least bytes to remove until the
model is within budget, and `rtx quantize --plan` reports and stores its plan. That the plans of the default model
keep int4 (and fp8, int4-g64, int4-g32, int4-gptq, int4-awq) within 0.5 perplexity on held-out text is `rtx gates`'
quality gate, which CI runs on 2,048 held-out tokens: about 75 s a plan on two cores, not repeated here."""

from __future__ import annotations

import json
import math
import random

import pytest

from rtxcore.models.resolve import resolve_model
from rtxcore.quant import calibration
from rtxcore.quant.layer_errors import OutputError
from rtxcore.quant.planner import Format, GroupPlan, Score, score, search
from tests.helpers.cli import rtx


def group(name: str, errors: list[float], nbytes: list[int]) -> GroupPlan:
    formats = [Format(m, {}, {name: OutputError(e, 0.0)}, b, b)
               for m, e, b in zip(["int4", "int8", None], [*errors, 0.0], nbytes)]
    return GroupPlan([name], formats, sizes={name: 100})


def at(ppl: float) -> Score:
    """A score whose bound is its own increase over a float perplexity of 10 (a confidence of 0.5)."""
    return Score(ppl, ppl - 10.0)


def test_search_moves_the_cheapest_error_first_until_within_budget():
    # Perplexity grows with the squared errors of the formats chosen; "b" has the largest error per byte.
    groups = [group("a", [0.10, 0.01], [50, 100, 200]), group("b", [0.40, 0.02], [50, 100, 200]),
              group("c", [0.10, 0.01], [500, 1000, 2000])]

    def evaluate(gs: list[GroupPlan]) -> Score:
        return at(10.0 + sum(gs[i].format.errors[g.names[0]].relative ** 2 * 20 for i, g in enumerate(gs)))

    plan = search(groups, evaluate, ppl_float=10.0, budget=0.5)
    assert plan.within_budget and plan.ppl - 10.0 <= 0.5
    assert [g.format.method for g in groups] == ["int4", "int8", "int4"]  # b's move is the first, and enough
    # The moves in order: b, a, c to int8, then b, a, c to float. Bisection scored three moves, then one.
    assert [s.moved for s in plan.steps[1:]] == [["b -> int8", "a -> int8", "c -> int8"], ["a -> int4", "c -> int4"]]
    assert plan.predicted_speedup() == pytest.approx(2400 / 650)


def test_search_stops_at_float_when_nothing_else_is_within_budget():
    groups = [group("a", [0.5, 0.4], [1, 2, 4])]
    plan = search(groups, lambda gs: at(10.0 + (1.0 if gs[0].format.method else 0.0)), ppl_float=10.0, budget=0.5)
    # Scored: int4, int8 (the middle of two moves), then float: the bisection ended there, on a run not yet scored.
    assert groups[0].format.method is None and plan.within_budget and len(plan.steps) == 3


def test_the_plan_is_the_shortest_run_of_moves_within_budget_found_by_bisection():
    # 40 groups, each int4 one adding 0.1 perplexity: within +2.25, 22 may stay int4. The moves: every group to int8,
    # the largest error (the highest-numbered group) first, then every group to float (no gain, in order): 80.
    groups = [group(f"g{i}", [0.1 + i / 1000, 0.0], [50, 100, 200]) for i in range(40)]
    scored: list[int] = []

    def evaluate(gs: list[GroupPlan]) -> Score:
        scored.append(sum(g.format.method == "int4" for g in gs))
        return at(10.0 + 0.1 * scored[-1])

    plan = search(groups, evaluate, ppl_float=10.0, budget=2.25)
    # The start, then 40, 20, 10, 15, 17 and 18 of the 80 moves made: log2(80) evaluations after the first.
    assert scored == [40, 0, 20, 30, 25, 23, 22]
    assert plan.within_budget and plan.ppl == pytest.approx(12.2)
    # Those moved are the most gainful (the largest error removed per byte: the highest-numbered groups).
    assert sorted(int(g.names[0][1:]) for g in groups if g.format.method == "int4") == list(range(22))
    assert plan.nbytes() == 22 * 50 + 18 * 100
    # Each step says what it moved, up or back; the last scored step is the plan, so nothing is added after it.
    assert [len(s.moved) for s in plan.steps] == [0, 40, 20, 10, 5, 2, 1]
    assert plan.steps[2].moved[0] == "g19 -> int4" and plan.steps[-1].moved == ["g22 -> int8"]


def test_a_bound_that_does_not_fall_with_every_move_still_ends_within_budget():
    # A measured bound can rise after a move: the bisection keeps the shortest run it scored within budget.
    groups = [group(f"g{i}", [0.1 + i / 1000, 0.0], [50, 100, 200]) for i in range(16)]
    bumps = {9: 5.0}  # int4 groups left -> extra increase, a spike the bisection may land on

    def evaluate(gs: list[GroupPlan]) -> Score:
        int4 = sum(g.format.method == "int4" for g in gs)
        return at(10.0 + 0.1 * int4 + bumps.get(int4, 0.0))

    plan = search(groups, evaluate, ppl_float=10.0, budget=0.95)
    assert plan.within_budget and all(s.bound <= 0.95 for s in plan.steps[-1:])
    assert sum(g.format.method == "int4" for g in groups) <= 9


def test_the_bound_holds_for_unseen_text_as_often_as_its_confidence_says():
    # Pieces whose increase of mean NLL is 0.03 +- 0.015 (as the default model's int4-awq plan's 512-token pieces):
    # the bound from 8 planning pieces is exceeded by another 8 pieces' increase about 5% of the time at 0.95.
    gen = random.Random(0)
    float_nlls = [2.5] * 8
    exceeded, trials = 0, 4000
    for _ in range(trials):
        planning = [2.5 + gen.gauss(0.03, 0.015) for _ in range(8)]
        unseen = [2.5 + gen.gauss(0.03, 0.015) for _ in range(8)]
        bound = score(planning, float_nlls, 0.95).bound
        exceeded += score(unseen, float_nlls, 0.5).bound > bound
    # Not 5%: z is the normal quantile while the spread is estimated from 8 pieces (Student's t with 7 degrees of
    # freedom would give 5%); about 7%, as the docs say.
    assert 0.055 < exceeded / trials < 0.09
    # At 0.5 the bound is the planning text's own increase; higher confidence, more spread or fewer pieces raise it.
    nlls = [2.53, 2.51, 2.55, 2.52]
    own = score(nlls, float_nlls[:4], 0.5)
    assert own.bound == pytest.approx(own.ppl - math.exp(2.5)) and own.ppl == pytest.approx(math.exp(2.5275))
    assert own.bound < score(nlls, float_nlls[:4], 0.9).bound < score(nlls, float_nlls[:4], 0.95).bound
    assert score(nlls * 2, float_nlls, 0.95).bound < score(nlls, float_nlls[:4], 0.95).bound
    assert score([2.53] * 4, float_nlls[:4], 0.95).bound == pytest.approx(score([2.53] * 4, float_nlls[:4], 0.5).bound)
    # A format that overflows scores as far over any budget as can be; one piece cannot give a spread.
    assert score([2.53, math.inf], [2.5, 2.5], 0.95) == Score(math.inf, math.inf)
    assert score([2.53, math.nan], [2.5, 2.5], 0.95).bound == math.inf
    with pytest.raises(ValueError, match="two or more pieces"):
        score([2.53], [2.5], 0.95)


@pytest.mark.model
def test_planning_text_is_spread_over_the_calibration_text_calibration_did_not_take():
    source = resolve_model("smollm2-135m")
    tokenizer, bos = source.tokenizer(), source.config.bos_token_id
    calib = calibration.calibration_chunks(tokenizer, bos, 1024, 512)
    taken = 2 * 511  # two pieces of 512 after a BOS each
    text_ids = tokenizer.encode(calibration.calibration_text(), add_special_tokens=False)
    assert [t for c in calib for t in c[1:]] == text_ids[:taken]
    plan = calibration.planning_chunks(tokenizer, bos, 2048, 256, taken)
    assert len(plan) == 8 and all(len(c) == 256 and c[0] == bos for c in plan)
    rest = text_ids[taken:]
    starts = [next(i for i in range(len(rest)) if rest[i:i + 255] == c[1:]) for c in plan]
    # Eight pieces an eighth of the rest apart, the first and last an sixteenth from its ends.
    pieces = len(rest) // 255
    assert pieces > 150 and starts == [(2 * i + 1) * pieces // 16 * 255 for i in range(8)]
    # Text too short for what is asked gives what there is, never what calibration took.
    short = calibration.calibration_text()[:8_000]
    short_ids = tokenizer.encode(short, add_special_tokens=False)
    pieces_short = calibration.planning_chunks(tokenizer, bos, 10**6, 256, taken, text=short)
    assert 0 < len(pieces_short) == (len(short_ids) - taken) // 255
    assert pieces_short[0][1:] == short_ids[taken:taken + 255]


@pytest.mark.model
def test_rtx_quantize_plan_reports_and_stores_its_plan(tmp_path):
    # int8 is within budget at its cheapest format: one scoring of the planning text (an int4 plan takes nine).
    out = tmp_path / "int8-plan"
    proc = rtx("quantize", "smollm2-135m", "--method", "int8", "--plan", "--out", str(out), "--calibration-tokens",
               "1024", "--eval-tokens", "512", "--json")
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    plan = report["plan"]
    assert plan["within_budget"] and plan["ppl_delta_budget"] == 0.5 and len(plan["steps"]) == 1, plan
    # Held-out text the plan never saw.
    assert report["evaluation"]["ppl_increase"] < 0.5, report["evaluation"]
    # Every layer quantized, and the plan reads about half of bf16's bytes.
    assert plan["layers_by_format"] == {"int8": 210} and plan["predicted_decode_speedup_vs_bf16"] > 1.9
    stored = json.loads((out / "quantization_report.json").read_text())
    assert stored["plan"] == plan
