"""What the sla-lanes scheduler predicts a new request's time to first token from: its lanes' queues and running
requests, the share of the engine more urgent lanes took recently, and the learnt step time. Admission refuses a
request whose prediction exceeds its lane's target, and brownout's pressure is the prediction over the target."""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from rtxcore.capacity.step_time import StepTimeModel
from rtxcore.lanes import LaneSpec
from rtxcore.request import Request

# A lane is never predicted to get less than this share of the engine (its wait then reads as 20x its work).
_MIN_SHARE_LEFT = 0.05


@dataclass(slots=True)
class LaneQueue:
    spec: LaneSpec
    waiting: deque[Request] = field(default_factory=deque)
    running: list[Request] = field(default_factory=list)
    # Tokens still to prefill over the waiting requests (what admission predicts from).
    queued_tokens: int = 0


class LaneShares:
    """Per lane (by priority): the tokens computed for lanes more urgent than it and all tokens computed, decayed
    like the step-time model's samples, over the steps in which it had work of its own. A step in which a lane had
    nothing queued or running says nothing about the share it would get: counting it, a lane whose every request was
    refused would read as starved by the others, and be refused for as long as they kept coming."""

    def __init__(self, num_lanes: int):
        self._contended = [[0.0, 0.0] for _ in range(num_lanes)]

    def observe(self, lanes: Sequence[LaneQueue], tokens: Sequence[int], keep: float) -> None:
        """One step's tokens per lane (by priority); ``keep`` is what is kept of the past."""
        total, above = sum(tokens), 0
        for lane, contended in zip(lanes, self._contended):
            if lane.waiting or lane.running:
                contended[0] = contended[0] * keep + above
                contended[1] = contended[1] * keep + total
            above += tokens[lane.spec.priority]

    def above(self, priority: int) -> float:
        """Share of recently computed tokens that went to lanes more urgent than ``priority``."""
        above, total = self._contended[priority]
        return above / total if total > 0 else 0.0


def predict_ttft(lanes: Sequence[LaneQueue], spec: LaneSpec, num_tokens: int, step_time: StepTimeModel, *,
                 max_num_seqs: int, max_num_batched_tokens: int, prefill_cap: int, share_above: float) -> float:
    """Seconds until a new request of ``spec``'s lane with ``num_tokens`` prompt tokens would get its first token;
    0 until the step-time model has seen enough steps to be trusted."""
    if not step_time.ready:
        return 0.0
    running = [r for lane in lanes for r in lane.running]
    num_decodes = sum(1 for r in running if r.num_computed_tokens >= r.num_prompt_tokens)
    prefill_per_step = max(1, min(max_num_batched_tokens - num_decodes, prefill_cap))
    ahead = num_tokens + sum(r.num_tokens - r.num_computed_tokens for r in running
                             if r.num_computed_tokens < r.num_prompt_tokens)
    num_ahead = 1
    for lane in lanes[:spec.priority + 1]:
        ahead += lane.queued_tokens
        num_ahead += len(lane.waiting)
    base_s, per_token_s = step_time.coefficients()
    decode_step_s = base_s + per_token_s * num_decodes
    # Every step carries the running decodes; the prefill work ahead is spread over as many steps as it needs.
    prefill_s = math.ceil(ahead / prefill_per_step) * decode_step_s + per_token_s * ahead
    # More urgent lanes keep arriving and go first: while this request waits, it gets only the share of the engine
    # they leave (what they took over the recent steps).
    stretch = 1.0 / max(1.0 - share_above, _MIN_SHARE_LEFT)
    # Slots: requests ahead beyond the free ones wait for running ones (that this lane cannot preempt) to end.
    holders = [r for r in running if r.lane not in spec.preempts]
    short = num_ahead - (max_num_seqs - len(holders))
    if short <= 0 or not holders:
        return prefill_s * stretch
    remaining = sorted(r.params.max_tokens - r.num_output_tokens for r in holders)
    rounds, index = divmod(short - 1, len(remaining))
    slot_s = (rounds * remaining[-1] + remaining[index]) * decode_step_s
    return stretch * max(prefill_s, slot_s + math.ceil(num_tokens / prefill_per_step) * decode_step_s
                         + per_token_s * num_tokens)
