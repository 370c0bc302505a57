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

The search starts with every group at its cheapest format and scores the model on planning text: pieces of the
calibration text that no statistic was taken from, spread over all of it. The increase it must hold within the budget
is not the planning text's own but an upper bound for unseen text as long (:func:`score`): how much the pieces'
increases differ says how far another text's may stray, and plans held to their planning text's own figure scored up to
+0.82 on held-out text. The moves up one format are ordered once, each group's next move weighed as
the previous one is made, by the output error it removes per unit of cost it adds (the squared relative output
error, summed over the group's layers and weighted by their size); the plan is the shortest run of them from the
start whose bound is within the budget, found by bisection over the run's length. Every scored step is in the report.
The held-out text then verifies the plan (``pipeline._evaluate``).
"""

from __future__ import annotations

import heapq
import math
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from rtxcore.contracts.quantizer import LayerStats, QuantizedTensor, Quantizer, check_stackable
from rtxcore.quant.layer_errors import OutputError, output_error


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


@dataclass(frozen=True, slots=True)
class Score:
    """A plan on the planning text: its perplexity, and the upper bound of its perplexity increase over the float
    model on unseen text as long, which the budget holds."""

    ppl: float
    bound: float


def score(nlls: Sequence[float], float_nlls: Sequence[float], confidence: float) -> Score:
    """From the mean negative log-likelihood of each planning piece (two or more pieces of one length), quantized and
    float.

    The increase of a piece's mean NLL varies from piece to piece (the built-in text's topics differ in how much
    quantization hurts them). Another text of as many pieces would see a mean increase that differs from the planning
    text's by the difference of two such means: a prediction interval, ``z * sd * sqrt(2 / n)`` above the planning
    text's mean with ``z`` the normal quantile of ``confidence`` (0.5: no margin). With the spread itself estimated
    from the n pieces the bound holds a little less often than ``confidence`` says (about 93% at 0.95 with the
    default 8 pieces, simulated in tests/quant/test_plan.py). Pieces spread over the text are close to independent;
    on the default model a 2,048-token stretch's increase varied as much as four spread pieces' of 512. The bound is
    in the planning text's perplexity: on a text of higher perplexity the same increase per token reads larger."""
    n = len(nlls)
    if n < 2 or len(float_nlls) != n:
        raise ValueError(f"a plan's score needs two or more pieces, each scored both ways; got {n} and "
                         f"{len(float_nlls)}")
    increases = [q - f for q, f in zip(nlls, float_nlls)]
    if not all(math.isfinite(d) for d in increases):  # a format that overflows: as far from the budget as can be
        return Score(math.inf, math.inf)
    mean = statistics.fmean(increases)
    z = statistics.NormalDist().inv_cdf(confidence) if confidence > 0.5 else 0.0
    ppl_float = math.exp(statistics.fmean(float_nlls))
    bound = ppl_float * math.expm1(min(mean + z * statistics.stdev(increases) * math.sqrt(2 / n), 700.0))
    return Score(math.exp(min(statistics.fmean(nlls), 700.0)), bound)


@dataclass(slots=True)
class PlanStep:
    ppl: float
    # The upper bound of the increase on unseen text (Score.bound).
    bound: float
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
    # The confidence of the bound the budget holds (:func:`score`).
    confidence: float = 0.5

    @property
    def ppl(self) -> float:
        return self.steps[-1].ppl

    @property
    def bound(self) -> float:
        return self.steps[-1].bound

    @property
    def within_budget(self) -> bool:
        return self.bound <= self.budget

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
                "planning_ppl": round(self.ppl, 4), "confidence": self.confidence,
                "ppl_increase_bound": round(self.bound, 4), "within_budget": self.within_budget,
                "layers_by_format": counts, "weight_bytes": self.nbytes(), "bf16_weight_bytes": self.bf16_bytes(),
                "predicted_decode_speedup_vs_bf16": round(self.predicted_speedup(), 3), "cost_basis": self.cost_basis,
                "steps": [{"ppl": round(s.ppl, 4), "ppl_increase_bound": round(s.bound, 4), "weight_bytes": s.nbytes,
                           "moved": s.moved} for s in self.steps]}


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


def search(groups: list[GroupPlan], evaluate: Callable[[list[GroupPlan]], Score], ppl_float: float, budget: float,
           log: Callable[[str], None] = lambda line: None, cost_basis: str = "weight bytes",
           confidence: float = 0.5) -> Plan:
    """Move groups up from their cheapest formats until ``evaluate`` (the planning text's :class:`Score`) bounds the
    increase over ``ppl_float`` within ``budget``, or every group is at float.

    The moves come in one order fixed before any scoring (:func:`move_order`), and the plan is the shortest run of
    them from the start that is within budget, found by bisection: about log2 of the number of moves in evaluations
    (9 for the default model's int4 plan, where moving an eighth of the movable groups a step, then cutting the last
    step back, took 14 at five seconds each on two cores). The bound need not fall with every move (it is measured):
    the bisection then still ends on a run it scored within budget (or at float), not always the shortest such run."""
    plan = Plan(groups, ppl_float, budget, [_step(evaluate(groups), groups, [])], cost_basis, confidence)
    log(f"plan: every group at its cheapest format: perplexity {plan.ppl:.3f} (float {ppl_float:.3f}), increase "
        f"bound {plan.bound:+.3f} (budget +{budget})")
    if plan.within_budget:
        return plan
    moves = move_order(groups)
    if not moves:  # every group at float already
        return plan
    applied = 0  # moves[:applied] are made

    def make(count: int) -> list[GroupPlan]:
        """Make exactly the first ``count`` moves; the groups that changed, each once, in move order."""
        nonlocal applied
        span = moves[min(count, applied):max(count, applied)]
        for g in span:
            g.chosen += 1 if count > applied else -1
        applied = count
        return list({id(g): g for g in span}.values())

    lo, hi, at_hi = 0, len(moves), None  # lo moves are over budget, hi within (all float: no error; scored if kept)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        direction = "up" if mid > applied else "back"
        changed = make(mid)
        plan.steps.append(_step(evaluate(groups), groups, _moves(changed)))
        groups_moved = f"{len(changed)} group{'s' if len(changed) != 1 else ''} {direction}"
        log(f"plan: {mid} of {len(moves)} moves made ({groups_moved}): perplexity {plan.ppl:.3f}, "
            f"bound {plan.bound:+.3f}, {plan.nbytes() / 2**20:.1f} MiB of layer weights")
        if plan.within_budget:
            hi, at_hi = mid, plan.steps[-1]
        else:
            lo = mid
    changed = make(hi)
    if at_hi is None:  # every move made: float throughout, scored like any other plan
        plan.steps.append(_step(evaluate(groups), groups, _moves(changed)))
        log(f"plan: every group at float: perplexity {plan.ppl:.3f}, bound {plan.bound:+.3f}")
    elif changed:  # back to a state already scored: its figures without another evaluation
        plan.steps.append(PlanStep(at_hi.ppl, at_hi.bound, plan.nbytes(), _moves(changed)))
        log(f"plan: {hi} of {len(moves)} moves kept: perplexity {plan.ppl:.3f}")
    return plan


def move_order(groups: list[GroupPlan]) -> list[GroupPlan]:
    """Every move up one format, most gainful first (:meth:`GroupPlan.gain_per_cost` at the time of the move: a
    group's next move is weighed once its previous one is made; ties in the groups' order): a group appears once per
    move. The groups are left as they were."""
    heap = [(-g.gain_per_cost(), i) for i, g in enumerate(groups) if g.gain_per_cost() >= 0]
    heapq.heapify(heap)
    start = [g.chosen for g in groups]
    order = []
    while heap:
        _, i = heapq.heappop(heap)
        g = groups[i]
        order.append(g)
        g.chosen += 1
        if (gain := g.gain_per_cost()) >= 0:
            heapq.heappush(heap, (-gain, i))
    for g, chosen in zip(groups, start):
        g.chosen = chosen
    return order


def _step(result: Score, groups: list[GroupPlan], moved: list[str]) -> PlanStep:
    return PlanStep(result.ppl, result.bound, sum(g.format.nbytes for g in groups), moved)


def _moves(groups: list[GroupPlan]) -> list[str]:
    return [f"{_short(g.names)} -> {g.format.method or 'float'}" for g in groups]


def _short(names: list[str]) -> str:
    parts = [n.removeprefix("model.").removesuffix(".weight") for n in names]
    return parts[0] if len(parts) == 1 else parts[0] + "|" + "|".join(p.rsplit(".", 1)[-1] for p in parts[1:])


def _nbytes(value: QuantizedTensor) -> int:
    return sum(t.numel() * t.element_size() for t in value.tensors.values())
