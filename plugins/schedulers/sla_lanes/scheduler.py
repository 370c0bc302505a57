"""The ``sla-lanes`` scheduler: three lanes with latency targets, priority with preemption and aging, admission
control from a learnt step-time model, a merge window for idle arrivals, and brownout under overload.

Each step, in order:

1. Running requests, most urgent lane first (decodes and continuing prefill chunks). When KV space runs out the
   least urgent, most recently admitted request is preempted.
2. Waiting requests: any that waited past its lane's aging bound (``max_wait_s``) first, oldest first; then by lane,
   first come first served. A lane that may preempt (realtime preempts bulk by default) takes the slot or KV space
   of the youngest running request of such a lane when it has no room.

``add_request`` is the admission point: it refuses at once (``AdmissionRefused``, a 429 with ``Retry-After``) when
the lane's queue is full, when brownout sheds the lane, or when the predicted time to first token exceeds the
lane's target.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any, Callable

from rtx_plugins.schedulers.sla_lanes.brownout import STEPS, BrownoutConfig, BrownoutController
from rtx_plugins.schedulers.sla_lanes.prediction import LaneQueue, LaneShares, predict_ttft
from rtxcore.capacity.step_time import StepTimeModel
from rtxcore.contracts import Scheduler, SchedulerConfig, SchedulerOutput
from rtxcore.contracts.scheduler import KVCacheAllocator, SchedulerStatus
from rtxcore.errors import AdmissionRefused, ConfigError
from rtxcore.kv.waiting_holds import WaitingHolds
from rtxcore.lanes import LANE_NAMES, LaneSpec
from rtxcore.request import Request, RequestStatus
from rtxcore.sampling_params import is_finite_number

# Weight of the newest request in a lane's measured TTFT ratio.
_TTFT_WEIGHT = 0.2
# Weight of the newest request in a lane's mean prompt (the request its exported TTFT prediction is for).
_PROMPT_WEIGHT = 0.1
# Per brownout evaluation, how much of a lane's measured TTFT ratio is kept (about 2 s to fade at 0.1 s intervals).
_MEASURED_FADE = 0.95
# Weight of the newest evaluation in the smoothed pressure (evaluations come every brownout interval).
_PRESSURE_WEIGHT = 0.3
# Share of the tightest waiting deadline's slack a merge window may use.
_MERGE_SLACK_SHARE = 0.1
# A brownout-shed request is told to come back no sooner than this.
_MIN_RETRY_AFTER_S = 1.0


@dataclass(slots=True)
class _Budget:
    """What is left of one step: tokens overall, and prompt tokens (brownout may shrink those)."""

    tokens: int
    prefill: int
    # Requests given tokens this step (a request admitted as overdue must not get a second chunk in its lane's turn).
    scheduled: set[Request] = field(default_factory=set)

    def grant(self, wanted: int) -> int:
        """Tokens a request wanting ``wanted`` more may compute this step (one is a decode)."""
        granted = min(wanted, self.tokens)
        return min(granted, self.prefill) if granted > 1 else granted

    def spend(self, num_tokens: int) -> None:
        self.tokens -= num_tokens
        if num_tokens > 1:
            self.prefill -= num_tokens


def _parse_options(options: Mapping[str, Any]) -> tuple[float, BrownoutConfig]:
    """The merge window (seconds) and the brownout ladder's settings.

    :raises ConfigError: an unknown option or setting, or a wrong value, named.
    """
    options = dict(options)
    merge_window_s = options.pop("merge_window_s", 0.002)
    if not is_finite_number(merge_window_s):
        raise ConfigError(f"merge_window_s must be a number of seconds, got {merge_window_s!r}")
    if merge_window_s < 0:
        raise ConfigError(f"merge_window_s must be >= 0, got {merge_window_s}")
    table = options.pop("brownout", None)
    if table is not None and not isinstance(table, Mapping):
        raise ConfigError(f"brownout must be a table of settings ([brownout]), got {table!r}")
    if options:
        raise ConfigError(f"unknown sla-lanes option {sorted(options)[0]!r} (options: merge_window_s, brownout)")
    return float(merge_window_s), BrownoutConfig.from_options(table)


class SLALanesScheduler(Scheduler):
    def __init__(self, config: SchedulerConfig, kv_cache: KVCacheAllocator,
                 clock: Callable[[], float] = time.monotonic):
        super().__init__(config, kv_cache)
        self.merge_window_s, brownout = _parse_options(config.options)
        if not config.speculative:  # nothing to pause: the ladder ends a step earlier
            brownout.max_level = min(brownout.max_level, STEPS.index("pause_speculation"))
        self.brownout = BrownoutController(brownout)
        self.clock = clock
        self.lanes = [LaneQueue(config.lanes[name]) for name in LANE_NAMES]
        self._by_name = {lane.spec.name: lane for lane in self.lanes}
        self.step_time = StepTimeModel()
        self._shares = LaneShares(len(self.lanes))
        # Recent time to first token over the target, per lane (exponentially weighted over requests).
        self._ttft_ratio = [0.0] * len(self.lanes)
        # Per lane: recent requests' prompt tokens to compute (exponentially weighted), and the time to first token
        # predicted for one such request arriving at the last brownout evaluation (what dashboards set beside the
        # measured one; replaced whole at each evaluation, never changed in place, so status() hands it out as is).
        self._mean_prompt = [0.0] * len(self.lanes)
        self._predicted_ttft: dict[str, float] = {}
        # When each live request arrived (scheduler clock): the start of its aging.
        self._arrival: dict[Request, float] = {}
        self._queued_tokens: dict[Request, int] = {}
        # Queue heads set aside during one schedule() while their prefix is copied back (see _admit_head).
        self._copying: list[Request] = []
        # Waiting requests holding a prefix lookup's blocks (they stepped aside while it came back).
        self._holding = WaitingHolds(kv_cache)
        # The previous schedule(): when it ran and how many tokens it scheduled (0: nothing ran).
        self._last_schedule_time: float | None = None
        self._last_num_tokens = 0
        self._next_brownout_check = float("-inf")
        self._pressure = 0.0

    @classmethod
    def check_options(cls, options: Mapping[str, Any]) -> None:
        _parse_options(options)

    @classmethod
    def describe(cls) -> dict[str, object]:
        return {"policy": "SLA lanes (realtime, standard, bulk) with aging", "chunked_prefill": True,
                "preemption": "recompute; realtime preempts bulk", "admission": "queue bound + predicted TTFT",
                "brownout": list(STEPS)}

    # -- bookkeeping ----------------------------------------------------------------------------------------------

    @property
    def num_waiting(self) -> int:
        return sum(len(lane.waiting) for lane in self.lanes)

    @property
    def num_running(self) -> int:
        return sum(len(lane.running) for lane in self.lanes)

    def allows_speculation(self) -> bool:
        return not self.brownout.active("pause_speculation")

    def status(self) -> SchedulerStatus:
        # Also the idle engine's tick: brownout must be able to leave its level when no step runs.
        self._maybe_update_brownout(self.clock())
        return SchedulerStatus(queued={lane.spec.name: len(lane.waiting) for lane in self.lanes},
                               running={lane.spec.name: len(lane.running) for lane in self.lanes},
                               brownout_level=self.brownout.level, brownout_steps=self.brownout.steps,
                               pressure=self.brownout.pressure,
                               step_time=self.step_time.coefficients() if self.step_time.ready else None,
                               predicted_ttft_s=self._predicted_ttft if self.step_time.ready else None)

    # -- admission ------------------------------------------------------------------------------------------------

    def add_request(self, req: Request) -> None:
        lane = self._by_name[req.lane]
        spec = lane.spec
        now = self.clock()
        num_tokens = req.num_tokens - req.num_computed_tokens
        if spec.name == "bulk" and self.brownout.active("shed_new_bulk"):
            raise AdmissionRefused(f"the server is in brownout (level {self.brownout.level}) and sheds new "
                                   f"{spec.name} requests; retry later", self.brownout.seconds_to_leave(now),
                                   "brownout")
        predicted = self.predict_ttft(spec, num_tokens)
        mean = self._mean_prompt[spec.priority]
        self._mean_prompt[spec.priority] = num_tokens if mean == 0 else mean + _PROMPT_WEIGHT * (num_tokens - mean)
        if len(lane.waiting) >= spec.max_queue:
            raise AdmissionRefused(f"the {spec.name} lane's queue is full ({spec.max_queue} requests)",
                                   max(predicted / max(len(lane.waiting), 1), _MIN_RETRY_AFTER_S), "queue_full")
        if predicted > spec.ttft_target_s:
            raise AdmissionRefused(
                f"predicted time to first token {predicted:.2f}s exceeds the {spec.name} lane's target of "
                f"{spec.ttft_target_s:g}s", max(predicted - spec.ttft_target_s, _MIN_RETRY_AFTER_S), "predicted_wait")
        if spec.name == "bulk" and self.brownout.active("cap_bulk_max_tokens"):
            self._cap_max_tokens(req)
        req.status = RequestStatus.WAITING
        self._arrival[req] = now
        self._push(lane, req, front=False)

    def predict_ttft(self, spec: LaneSpec, num_tokens: int) -> float:
        """Seconds until a new request of ``spec``'s lane with ``num_tokens`` prompt tokens would get its first
        token (see :func:`predict_ttft`)."""
        return predict_ttft(self.lanes, spec, num_tokens, self.step_time, max_num_seqs=self.config.max_num_seqs,
                            max_num_batched_tokens=self.config.max_num_batched_tokens,
                            prefill_cap=self._prefill_cap(), share_above=self._shares.above(spec.priority))

    # -- the step -------------------------------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        now = self.clock()
        self._learn_step_time(now)
        self._maybe_update_brownout(now)
        out = self._hold(now) or self._build(now)
        self._count_lane_tokens(out, now)
        self._last_schedule_time = now
        self._last_num_tokens = out.total_num_scheduled_tokens
        return out

    def _build(self, now: float) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = _Budget(self.config.max_num_batched_tokens, self._prefill_cap())
        # Decodes first, most urgent lane first: every streaming request keeps its inter-token latency.
        for lane in self.lanes:
            self._continue_running(lane, out, budget, decodes=True)
        # Then prefill work: requests past their aging bound, then lane by lane its running chunks and its queue,
        # so a realtime newcomer's prompt goes before the rest of a long bulk prompt. Admitting new work right after
        # running out of KV space would only preempt again.
        admitting = not out.preempted and self._admit_overdue(now, out, budget)
        for lane in self.lanes:
            self._continue_running(lane, out, budget, decodes=False)
            while admitting and lane.waiting and budget.tokens > 0:
                admitting = self._admit_head(lane, now, out, budget)
        for req in self._copying:
            self._push(self._by_name[req.lane], req, front=True)
        self._copying.clear()
        return out

    def _continue_running(self, lane: LaneQueue, out: SchedulerOutput, budget: _Budget, decodes: bool) -> None:
        for req in list(lane.running):
            if budget.tokens <= 0:
                return
            # A decode computes its last token and the proposed tokens that follow it (speculative decoding).
            left = req.num_tokens_with_spec - req.num_computed_tokens
            is_decode = req.num_tokens - req.num_computed_tokens == 1
            # Preempted earlier in this step, or not this phase's kind of work.
            if req.status is not RequestStatus.RUNNING or is_decode != decodes or req in budget.scheduled:
                continue
            num_new = budget.grant(left)
            if num_new <= 0:
                continue
            if (not self.kv_cache.allocate(req, num_new) and not self._allocate_without_holds(req, num_new)
                    and not self._preempt_until_fits(req, num_new, out)):
                continue
            self._add_to_step(out, req, num_new)
            budget.spend(num_new)
            budget.scheduled.add(req)

    def _admit_overdue(self, now: float, out: SchedulerOutput, budget: _Budget) -> bool:
        """Admit every queue head past its aging bound, oldest first; False when one could not be placed."""
        while budget.tokens > 0:
            overdue = [lane for lane in self.lanes
                       if lane.waiting and now - self._arrival[lane.waiting[0]] >= lane.spec.max_wait_s]
            if not overdue:
                return True
            lane = min(overdue, key=lambda lane: self._arrival[lane.waiting[0]])
            if not self._admit_head(lane, now, out, budget):
                return False
        return True

    def _admit_head(self, lane: LaneQueue, now: float, out: SchedulerOutput, budget: _Budget) -> bool:
        """Start the head of ``lane``'s queue; False (and nothing held) when it cannot run this step, in which case
        nobody behind it may jump the queue. A head whose prefix is still being copied back from a lower tier steps
        aside for this step, keeping its hold and its place (True: those behind it may go meanwhile)."""
        req = lane.waiting[0]
        if req in out.preempted:
            return False  # it made room for another this step; it cannot run in the same one
        if req.num_computed_tokens == 0:
            if self._copying and self.num_running + len(self._copying) >= self.config.max_num_seqs:
                # Requests whose prefix is on the way take the places left: each holds device blocks for its copy,
                # and starting copies for more than can run next would fill the pool with blocks nobody can run on.
                return False
            req.num_computed_tokens = self.kv_cache.lookup_prefix(req)
        if not self.kv_cache.ready(req):
            self._copying.append(self._pop(lane))
            self._holding.add(req)
            return True
        left = req.num_tokens_with_spec - req.num_computed_tokens
        num_new = budget.grant(left)
        if num_new <= 0 or (num_new < left and not self.config.enable_chunked_prefill) \
                or not self._make_room(lane, req, num_new, out, now):
            self._release(req)
            return False
        if out.preempted:  # a victim scheduled earlier in this step gave its tokens back
            budget.tokens = self.config.max_num_batched_tokens - out.total_num_scheduled_tokens - num_new
        else:
            budget.spend(num_new)
        self._pop(lane)
        self._holding.forget(req)
        if req.status is RequestStatus.WAITING:
            req.num_cached_tokens = req.num_computed_tokens
        req.status = RequestStatus.RUNNING
        lane.running.append(req)
        self._add_to_step(out, req, num_new)
        budget.scheduled.add(req)
        return True

    def _make_room(self, lane: LaneQueue, req: Request, num_new: int, out: SchedulerOutput, now: float) -> bool:
        """A slot and KV space for ``req``, preempting running requests of lanes it may preempt if need be.

        Requests that waited past their aging bound are never victims: preempting them again would starve them.
        """
        victims = [v for name in reversed(LANE_NAMES) if name in lane.spec.preempts
                   for v in reversed(self._by_name[name].running)
                   if now - self._arrival[v] < self._by_name[name].spec.max_wait_s]
        while True:
            if self.num_running < self.config.max_num_seqs and (self.kv_cache.allocate(req, num_new)
                                                                 or self._allocate_without_holds(req, num_new)):
                return True
            if not victims:
                return False
            self._preempt(victims.pop(0), out)

    def _allocate_without_holds(self, req: Request, num_new: int) -> bool:
        """Allocate for ``req`` after dropping the prefix holds of waiting requests (those whose prefix is coming back
        from a lower tier, or was when they last stepped aside); False when nothing was held or it still does not
        fit. A hold is cheaper to give up than a running request: nothing has been computed on it, its blocks stay
        in the prefix cache, and the lookup is redone. Without this, requests holding copies behind a queue head that
        cannot fit would wait until aging reached them, the pool held meanwhile."""
        return self._holding.release_all_but(req) and self.kv_cache.allocate(req, num_new)

    def _preempt_until_fits(self, req: Request, num_new: int, out: SchedulerOutput) -> bool:
        """Preempt the least urgent, youngest running requests until ``req`` fits; False if ``req`` had to go."""
        for lane in reversed(self.lanes):
            while lane.running:
                victim = lane.running[-1]
                self._preempt(victim, out)
                if victim is req:
                    return False
                if self.kv_cache.allocate(req, num_new):
                    return True
        return False

    def _preempt(self, req: Request, out: SchedulerOutput) -> None:
        lane = self._by_name[req.lane]
        lane.running.remove(req)
        if req in out.scheduled:  # scheduled earlier this step: take it back out
            index = out.scheduled.index(req)
            del out.scheduled[index], out.num_scheduled_tokens[index]
        self.kv_cache.free(req)
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        req.status = RequestStatus.PREEMPTED
        self._push(lane, req, front=True)
        out.preempted.append(req)

    def _hold(self, now: float) -> SchedulerOutput | None:
        """A merge window: with nothing running, hold fresh arrivals briefly so they prefill together, never past
        the point where the tightest waiting deadline would be at risk."""
        if self.merge_window_s <= 0 or self.num_running or not self.num_waiting:
            return None
        heads = [lane for lane in self.lanes if lane.waiting]
        first = min(self._arrival[r] for lane in heads for r in lane.waiting)
        queued = sum(lane.queued_tokens for lane in self.lanes)
        prefill_s = self.step_time.predict(min(queued, self.config.max_num_batched_tokens)) \
            if self.step_time.ready else 0.0
        slack = min(self._arrival[r] + lane.spec.ttft_target_s for lane in heads for r in lane.waiting) \
            - now - prefill_s
        # A merge window buys batching, so it may spend only a small part of the tightest request's slack.
        window = min(self.merge_window_s, _MERGE_SLACK_SHARE * slack)
        end = first + window
        # Compared as the end time itself: a clock that lands exactly on it (a simulation's) ends the hold, where
        # `now - first >= window` could round below it and hold for no time.
        if now >= end:
            return None
        return SchedulerOutput(hold_s=end - now)

    # -- brownout -------------------------------------------------------------------------------------------------

    def _maybe_update_brownout(self, now: float) -> None:
        if now >= self._next_brownout_check:
            self._next_brownout_check = now + self.brownout.config.interval_s
            self._update_brownout(now)

    def _update_brownout(self, now: float) -> None:
        pressure, cause = 0.0, "no load"
        busy = self.num_running + self.num_waiting > 0
        for lane in self.lanes[:-1]:  # the lowest lane is what brownout sacrifices, not what it protects
            ratio = self.predict_ttft(lane.spec, 0) / lane.spec.ttft_target_s
            if ratio > pressure:
                pressure, cause = ratio, f"{lane.spec.name} lane predicted TTFT at {ratio:.2f}x its target"
            # What requests actually waited lags but does not depend on the model being right; it fades when no
            # request of the lane starts (a stale figure must not hold brownout).
            self._ttft_ratio[lane.spec.priority] *= _MEASURED_FADE
            measured = self._ttft_ratio[lane.spec.priority] if busy else 0.0
            if measured > pressure:
                pressure, cause = measured, f"{lane.spec.name} lane measured TTFT at {measured:.2f}x its target"
        if self.step_time.ready:
            self._predicted_ttft = {lane.spec.name: self.predict_ttft(lane.spec, round(
                self._mean_prompt[lane.spec.priority])) for lane in self.lanes}
        streaming = [lane.spec.itl_target_s for lane in self.lanes if lane.running]
        if streaming and self.step_time.ready:
            ratio = self.step_time.predict(self._last_num_tokens) / min(streaming)
            if ratio > pressure:
                pressure, cause = ratio, f"step time at {ratio:.2f}x the tightest inter-token target"
        # Smoothed: one noisy evaluation must not reset the controller's hold timers.
        self._pressure += _PRESSURE_WEIGHT * (pressure - self._pressure)
        self.brownout.update(now, self._pressure, cause, idle=not busy)
        if self.brownout.active("cap_bulk_max_tokens"):
            bulk = self._by_name["bulk"]
            for req in (*bulk.waiting, *bulk.running):
                self._cap_max_tokens(req)

    def _cap_max_tokens(self, req: Request) -> None:
        cap = max(self.brownout.config.bulk_max_tokens, req.num_output_tokens + req.num_pending_tokens + 1)
        if req.params.max_tokens > cap:
            req.params = replace(req.params, max_tokens=cap)

    def _prefill_cap(self) -> int:
        if self.brownout.active("shrink_prefill_chunk"):
            return self.brownout.config.prefill_chunk
        return self.config.max_num_batched_tokens

    # -- helpers --------------------------------------------------------------------------------------------------

    def _learn_step_time(self, now: float) -> None:
        # Only back-to-back steps measure a step: after an idle schedule() the gap includes waiting for work.
        if self._last_schedule_time is not None and self._last_num_tokens:
            self.step_time.observe(self._last_num_tokens, now - self._last_schedule_time)

    def _count_lane_tokens(self, out: SchedulerOutput, now: float) -> None:
        """Per-lane token shares, and the time to first token each request completing its prompt this step sees
        (its first token comes out of this step): the measured side of brownout's pressure."""
        keep = 1.0 - self.step_time.forget
        tokens = [0] * len(self.lanes)
        for req, n in zip(out.scheduled, out.num_scheduled_tokens):
            lane = self._by_name[req.lane]
            tokens[lane.spec.priority] += n
            if req.num_computed_tokens < req.num_prompt_tokens <= req.num_computed_tokens + n:
                ratio = (now - self._arrival[req]) / lane.spec.ttft_target_s
                self._ttft_ratio[lane.spec.priority] += _TTFT_WEIGHT * (ratio - self._ttft_ratio[lane.spec.priority])
        self._shares.observe(self.lanes, tokens, keep)

    @staticmethod
    def _add_to_step(out: SchedulerOutput, req: Request, num_new: int) -> None:
        out.scheduled.append(req)
        out.num_scheduled_tokens.append(num_new)

    def _push(self, lane: LaneQueue, req: Request, front: bool) -> None:
        """Queue ``req``; a preempted one (``front``) goes back to its place by arrival, so each lane's queue stays
        oldest first and its head is the one aging promotes."""
        n = req.num_tokens - req.num_computed_tokens
        self._queued_tokens[req] = n
        lane.queued_tokens += n
        if not front:
            lane.waiting.append(req)
            return
        arrival = self._arrival[req]
        index = next((i for i, other in enumerate(lane.waiting) if self._arrival[other] > arrival), len(lane.waiting))
        lane.waiting.insert(index, req)

    def _pop(self, lane: LaneQueue) -> Request:
        req = lane.waiting.popleft()
        lane.queued_tokens -= self._queued_tokens.pop(req)
        return req

    def _release(self, req: Request) -> None:
        # Drop the prefix-cache hold taken by lookup_prefix; the lookup is redone when the request is retried.
        self._holding.release(req)

    def finish_request(self, req: Request) -> None:
        lane = self._by_name.get(req.lane)
        if lane is not None:
            if req in lane.running:
                lane.running.remove(req)
            elif req in self._queued_tokens:
                lane.waiting.remove(req)
                lane.queued_tokens -= self._queued_tokens.pop(req)
        self._arrival.pop(req, None)
        self._holding.forget(req)
        self.kv_cache.free(req)
