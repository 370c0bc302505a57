"""The planner's costs: each group's formats ordered by cost with the ones no more accurate than a cheaper one
dropped, kernel times measured at a model's shapes (rtxcore.quant.format_costs), and `rtx quantize --plan` choosing
by a table of them."""

from __future__ import annotations

import json

import pytest

from rtxcore.errors import ConfigError
from rtxcore.models.dummy import SHAPES
from rtxcore.quant.format_costs import FormatCosts, decode_shapes, measure
from rtxcore.quant.layer_errors import OutputError
from rtxcore.quant.planner import Format, GroupPlan, Score, pareto_front, search
from rtxcore.registry import load_plugins
from tests.helpers.cli import assert_one_line_error, rtx

SIZES = {"w": 100}


def fmt(method: str | None, error: float, cost: float) -> Format:
    return Format(method, {}, {"w": OutputError(error, 0.0)}, nbytes=int(cost), cost=cost)


def test_the_front_orders_by_cost_and_drops_formats_no_more_accurate_than_a_cheaper_one():
    # As on the H200 at the default model's shapes: int8 is cheaper than int4 and more accurate, so int4 never pays.
    int4, int8, fp8, bf16 = fmt("int4", 0.10, 9.0), fmt("int8", 0.01, 6.7), fmt("fp8", 0.03, 6.4), fmt(None, 0.0, 15.0)
    assert [f.method for f in pareto_front([int4, int8, fp8, bf16], SIZES)] == ["fp8", "int8", None]
    # Equal costs keep their order (with bytes as the cost an fp8 plan starts in fp8 and may move to int8 for free); a
    # later one no more accurate is dropped.
    assert [f.method for f in pareto_front([fmt("fp8", 0.03, 5.0), fmt("int8", 0.01, 5.0), bf16], SIZES)] == \
        ["fp8", "int8", None]
    assert [f.method for f in pareto_front([fmt("int8", 0.01, 5.0), fmt("fp8", 0.03, 5.0), bf16], SIZES)] == \
        ["int8", None]
    # Float cheaper than every quantized format: nothing is worth quantizing.
    assert [f.method for f in pareto_front([int4, fmt(None, 0.0, 1.0)], SIZES)] == [None]


def test_search_moves_by_error_removed_per_unit_of_measured_cost():
    # Both groups start in int4; moving "cheap" to int8 costs 1 unit, "dear" 10, for the same error removed: the
    # budget allows one move, and it is the cheap one. The predicted speed-up is float's cost over the plan's.
    def group(name: str, int8_cost: float) -> GroupPlan:
        formats = [Format("int4", {}, {name: OutputError(0.1, 0.0)}, 50, 5.0),
                   Format("int8", {}, {name: OutputError(0.0001, 0.0)}, 100, 5.0 + int8_cost),
                   Format(None, {}, {name: OutputError(0.0, 0.0)}, 200, 40.0)]
        return GroupPlan([name], formats, sizes={name: 100})

    groups = [group("dear", 10.0), group("cheap", 1.0)]

    def evaluate(gs: list[GroupPlan]) -> Score:
        increase = sum(0.4 for g in gs if g.format.method == "int4")
        return Score(10.0 + increase, increase)

    plan = search(groups, evaluate, ppl_float=10.0, budget=0.5, cost_basis="kernel time on a test table")
    assert [g.format.method for g in groups] == ["int4", "int8"]
    assert plan.predicted_speedup() == pytest.approx(80.0 / 11.0)
    assert plan.to_json()["cost_basis"] == "kernel time on a test table"


def test_measure_times_every_format_at_every_decode_shape_on_the_cpu():
    registry = load_plugins()
    config = SHAPES["tiny"]
    shapes = decode_shapes(config)
    # q|k|v (4 heads of 16 and 2 kv heads), o, gate|up, down.
    assert shapes == [(128, 64), (64, 64), (256, 64), (64, 128)]
    costs = measure(shapes, ["int8"], lambda name: registry.create("quantizer", name), "cpu")
    assert set(costs.seconds) == {"bf16", "int8"}
    for by_shape in costs.seconds.values():
        assert set(by_shape) == {"128x64", "64x64", "256x64", "64x128"} and all(v > 0 for v in by_shape.values())
    assert costs.cost(None, (64, 64)) == costs.seconds["bf16"]["64x64"]
    with pytest.raises(ConfigError, match="no fp8 at 64x64"):
        costs.cost("fp8", (64, 64))


@pytest.mark.parametrize("content, message", [
    (None, "cannot read it"),
    ("[1, 2", "not JSON"),
    (json.dumps({"seconds": {"int8": {"64x64": -1}}}), "not a format cost table"),
])
def test_a_file_that_is_no_cost_table_is_refused(tmp_path, content, message):
    path = tmp_path / "costs.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises(ConfigError, match=message):
        FormatCosts.from_file(path)


@pytest.mark.parametrize("args, fragment", [
    (["--format-costs", "measure"], "apply to a plan: add --plan"),
    (["--plan", "--plan-formats", "int4,bogus"], "--plan-formats: unknown quantization method 'bogus'"),
    (["--plan", "--format-costs", "/nonexistent/costs.json"], "--format-costs /nonexistent/costs.json: cannot read"),
])
def test_bad_plan_options_are_refused_in_one_line(tmp_path, args, fragment):
    proc = rtx("quantize", "smollm2-135m", "--method", "int4", "--out", str(tmp_path / "out"), *args)
    assert_one_line_error(proc, fragment)
    assert not (tmp_path / "out").exists()


@pytest.mark.model
def test_a_plan_with_a_cost_table_never_chooses_a_format_a_cheaper_one_beats(tmp_path):
    # A table where int4 costs more than int8 at every shape of the default model (as the H200 measured): int8 is
    # also more accurate, so no group can be int4, whatever the budget.
    shapes = ["960x576", "576x576", "3072x576", "576x1536"]
    table = {"device": "a test table", "seconds": {"bf16": dict.fromkeys(shapes, 15e-6),
                                                   "int4": dict.fromkeys(shapes, 9e-6),
                                                   "int8": dict.fromkeys(shapes, 6e-6)}}
    (tmp_path / "costs.json").write_text(json.dumps(table))
    out = tmp_path / "plan"
    proc = rtx("quantize", "smollm2-135m", "--method", "int4", "--plan", "--format-costs", str(tmp_path / "costs.json"),
               "--calibration-tokens", "1024", "--eval-tokens", "0", "--out", str(out), "--json")
    assert proc.returncode == 0, proc.stderr
    plan = json.loads(proc.stdout)["plan"]
    assert plan["cost_basis"] == "kernel time on a test table"
    assert "int4" not in plan["layers_by_format"] and plan["layers_by_format"].get("int8", 0) > 0, plan
    # Predicted from the table: 15 / 6 with every group int8, less for each group left in float.
    if "float" in plan["layers_by_format"]:
        assert 1 < plan["predicted_decode_speedup_vs_bf16"] < 2.5
    else:
        assert plan["predicted_decode_speedup_vs_bf16"] == pytest.approx(2.5, abs=0.001)
