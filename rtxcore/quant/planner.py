"""The mixed-precision planner: each group of linear layers that run fused (q|k|v, o, gate|up, down) gets the cheapest
format that keeps the whole model within a perplexity budget.

Formats: the method asked for and its fallbacks (int4 -> int8, fp8 -> int8, int4-gptq -> int4 -> int8), or the
formats ``--plan-formats`` lists, then the checkpoint's own precision. A format's cost at a group is what decoding
costs with it: by default the bytes its weights take (decode at small batches reads every weight once a token; int4
ran at 0.58x of bf16's W3 time on the H200 with 0.36x of its bytes, int8 at 0.65x with 0.57x; docs/benchmarks.md),
or the time of its kernel at the group's shape measured on the serving device (``rtxcore.quant.format_costs``). Each
group's formats are ordered by cost, and a format is dropped when one before it, no dearer, has no larger output
error (the Pareto front of cost and error): every move up buys accuracy. The predicted speed-up of a plan is
the float cost of the planned layers over their planned cost.

The search starts with every group at its cheapest format and measures the model's perplexity on planning text (a
slice of the calibration text that no statistic was taken from, never the held-out text). While the increase over the
float model is above the budget, it moves up one format the groups whose move buys the most output error per unit of
cost (the squared relative output error, summed over the group's layers and weighted by their size, that the move
removes), an eighth of the groups that can still move at a time, and measures again. Every step is in the report.
The held-out text then verifies the plan (``pipeline._evaluate``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from rtxcore.contracts.quantizer import LayerStats, QuantizedTensor, Quantizer, check_stackable
from rtxcore.quant.layer_errors import OutputError, output_error

# The share of still-movable groups moved up per round: smaller finds a cheaper plan, larger needs fewer evaluations.
MOVE_FRACTION = 1 / 8


@dataclass(slots=True)
class Format:
    """One way to store a group: a method's quantized tensors (None: the checkpoint's precision)."""

    method: str | None
    qtensors: dict[str, QuantizedTensor]
    errors: dict[str, OutputError]
    # Bytes of the group's weights in this format (bf16 for the checkpoint's precision: what decode reads).
    nbytes: int
    # What decoding the group costs in this format: its bytes, or measured seconds (rtxcore.quant.format_costs).
    cost: float = 0.0

    def squared_error(self, sizes: dict[str, int]) -> float:
        return sum(e.relative ** 2 * sizes[name] for name, e in self.errors.items())


@dataclass(slots=True)
class GroupPlan:
    names: list[str]
    # Cheapest first; the last is the checkpoint's precision.
    formats: list[Format]
    chosen: int = 0
    sizes: dict[str, int] = field(default_factory=dict)

    @property
    def format(self) -> Format:
        return self.formats[self.chosen]

    def gain_per_cost(self) -> float:
        """Squared error removed per unit of cost added by moving one format up; -1 when it cannot move."""
        if self.chosen + 1 >= len(self.formats):
            return -1.0
        now, up = self.format, self.formats[self.chosen + 1]
        extra = max(up.cost - now.cost, 1e-12)  # a move at no cost (a tie on the front) is worth the most
        return (now.squared_error(self.sizes) - up.squared_error(self.sizes)) / extra


@dataclass(slots=True)
class PlanStep:
    ppl: float
    nbytes: int
    moved: list[str]


@dataclass(slots=True)
class Plan:
    groups: list[GroupPlan]
    ppl_float: float
    budget: float
    steps: list[PlanStep]
    # What the formats' costs are: "weight bytes", or the device the kernels were timed on.
    cost_basis: str = "weight bytes"

    @property
    def ppl(self) -> float:
        return self.steps[-1].ppl

    @property
    def within_budget(self) -> bool:
        return self.ppl - self.ppl_float <= self.budget

    def bf16_bytes(self) -> int:
        return sum(g.formats[-1].nbytes for g in self.groups)

    def nbytes(self) -> int:
        return sum(g.format.nbytes for g in self.groups)

    def predicted_speedup(self) -> float:
        planned = sum(g.format.cost for g in self.groups)
        return sum(g.formats[-1].cost for g in self.groups) / planned if planned > 0 else 1.0

    def to_json(self) -> dict[str, Any]:
        counts: dict[str, int] = {}
        for g in self.groups:
            key = g.format.method or "float"
            counts[key] = counts.get(key, 0) + len(g.names)
        return {"ppl_delta_budget": self.budget, "planning_ppl_float": round(self.ppl_float, 4),
                "planning_ppl": round(self.ppl, 4), "within_budget": self.within_budget,
                "layers_by_format": counts, "weight_bytes": self.nbytes(), "bf16_weight_bytes": self.bf16_bytes(),
                "predicted_decode_speedup_vs_bf16": round(self.predicted_speedup(), 3), "cost_basis": self.cost_basis,
                "steps": [{"ppl": round(s.ppl, 4), "weight_bytes": s.nbytes, "moved_up": s.moved}
                          for s in self.steps]}


def group_formats(names: list[str], weights: dict[str, torch.Tensor], stats: dict[str, LayerStats],
                  chain: Sequence[str], quantizer_for: Callable[[str], Quantizer],
                  cost_of: Callable[[str | None, tuple[int, int]], float] | None = None) -> GroupPlan:
    """The formats of ``chain`` (then float) worth choosing for one group, cheapest first, with their output errors,
    bytes and costs: ``cost_of(method or None, fused shape)``, or bytes without it."""
    shape = (sum(weights[n].shape[0] for n in names), weights[names[0]].shape[1])
    sizes = {n: weights[n].numel() for n in names}
    formats = []
    for method in chain:
        quantizer = quantizer_for(method)
        qts = {n: quantizer.quantize(weights[n], stats[n]) if quantizer.calibrated else quantizer.quantize(weights[n])
               for n in names}
        check_stackable(list(qts.values()))
        errors = {n: output_error(quantizer, weights[n], qts[n], stats[n].sample) for n in names}
        nbytes = sum(_nbytes(q) for q in qts.values())
        formats.append(Format(method, qts, errors, nbytes, cost_of(method, shape) if cost_of else nbytes))
    zero = OutputError(0.0, math.inf)
    nbytes = sum(2 * weights[n].numel() for n in names)
    formats.append(Format(None, {}, {n: zero for n in names}, nbytes, cost_of(None, shape) if cost_of else nbytes))
    return GroupPlan(names, pareto_front(formats, sizes), sizes=sizes)


def pareto_front(formats: list[Format], sizes: dict[str, int]) -> list[Format]:
    """Cheapest first, each more accurate than every format before it: a format that costs as much as one before it
    or more without being more accurate is never the better choice. Formats of equal cost keep their given order (the
    method asked for first: with weight bytes as the cost, fp8 and int8 tie, and an fp8 plan starts in fp8 and moves
    to int8 at no cost). Float (no error) ends it."""
    front: list[Format] = []
    for f in sorted(formats, key=lambda f: f.cost):  # stable: ties stay in the given order
        if not front or f.squared_error(sizes) < front[-1].squared_error(sizes):
            front.append(f)
    return front


def search(groups: list[GroupPlan], evaluate: Callable[[list[GroupPlan]], float], ppl_float: float, budget: float,
           log: Callable[[str], None] = lambda line: None, cost_basis: str = "weight bytes") -> Plan:
    """Move groups up from their cheapest formats until ``evaluate`` (perplexity on planning text) is within
    ``budget`` of ``ppl_float``, or every group is at float."""
    plan = Plan(groups, ppl_float, budget, [PlanStep(evaluate(groups), sum(g.format.nbytes for g in groups), [])],
                cost_basis)
    log(f"plan: every group at its cheapest format: perplexity {plan.ppl:.3f} (float {ppl_float:.3f}, "
        f"budget +{budget})")
    while not plan.within_budget:
        movable = sorted((g for g in groups if g.gain_per_cost() >= 0), key=lambda g: -g.gain_per_cost())
        if not movable:
            break
        moved = movable[:max(1, math.ceil(len(movable) * MOVE_FRACTION))]
        for g in moved:
            g.chosen += 1
        names = [f"{_short(g.names)} -> {g.format.method or 'float'}" for g in moved]
        plan.steps.append(PlanStep(evaluate(groups), plan.nbytes(), names))
        log(f"plan: {len(moved)} groups moved up: perplexity {plan.ppl:.3f}, {plan.nbytes() / 2**20:.1f} MiB of "
            f"layer weights")
    return plan


def _short(names: list[str]) -> str:
    parts = [n.removeprefix("model.").removesuffix(".weight") for n in names]
    return parts[0] if len(parts) == 1 else parts[0] + "|" + "|".join(p.rsplit(".", 1)[-1] for p in parts[1:])


def _nbytes(value: QuantizedTensor) -> int:
    return sum(t.numel() * t.element_size() for t in value.tensors.values())
