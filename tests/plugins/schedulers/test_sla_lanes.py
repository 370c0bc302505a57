"""The sla-lanes scheduler on a simulated clock, over the real KV-cache manager: budget, aging, preemption, admission,
the merge window, and brownout's hysteresis — with property tests (hypothesis) for the invariants."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rtx_plugins.schedulers.sla_lanes import SLALanesScheduler
from rtx_plugins.schedulers.sla_lanes.brownout import (
    STEPS,
    BrownoutConfig,
    BrownoutController,
)
from rtxcore.capacity.step_time import StepTimeModel
from rtxcore.contracts import SchedulerConfig
from rtxcore.errors import AdmissionRefused, ConfigError
from rtxcore.lanes import DEFAULT_LANES, LANE_NAMES, parse_lanes
from rtxcore.request import Request, RequestStatus
from rtxcore.sampling_params import SamplingParams
from tests.helpers.kv import make_manager

STEP_S = 0.05


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@dataclass
class Sim:
    """Plays the engine: schedule, count tokens computed, append a token when a request's known ones are done,
    finish at max_tokens; the clock advances STEP_S per step."""

    scheduler: SLALanesScheduler
    clock: FakeClock
    live: dict[str, Request] = field(default_factory=dict)
    arrival: dict[str, float] = field(default_factory=dict)
    first_scheduled: dict[str, float] = field(default_factory=dict)
    finished: list[str] = field(default_factory=list)
    refused: list[AdmissionRefused] = field(default_factory=list)
    preempted: list[str] = field(default_factory=list)

    def add(self, req_id: str, lane: str, prompt_len: int, max_tokens: int) -> bool:
        req = Request(req_id, [1 + (hash(req_id) + i) % 500 for i in range(prompt_len)],
                      SamplingParams(max_tokens=max_tokens), lane=lane)
        try:
            self.scheduler.add_request(req)
        except AdmissionRefused as exc:
            self.refused.append(exc)
            return False
        self.live[req_id] = req
        self.arrival[req_id] = self.clock.now
        return True

    def step(self, check=None):
        waiting_before = {r.req_id for r in self.live.values() if r.status is not RequestStatus.RUNNING}
        out = self.scheduler.schedule()
        if check is not None:
            check(out, waiting_before)
        budget = self.scheduler.config.max_num_batched_tokens
        assert out.total_num_scheduled_tokens <= budget
        assert self.scheduler.num_waiting + self.scheduler.num_running == len(self.live)
        self.preempted += [r.req_id for r in out.preempted]
        for req in out.preempted:
            assert req.req_id in self.live and req.num_computed_tokens == 0
        for req, n in zip(out.scheduled, out.num_scheduled_tokens):
            self.first_scheduled.setdefault(req.req_id, self.clock.now)
            req.num_computed_tokens += n
            if req.num_computed_tokens == req.num_tokens:
                req.all_token_ids.append(7)
                if req.num_output_tokens >= req.params.max_tokens:
                    req.status = RequestStatus.FINISHED_LENGTH
                    self.scheduler.finish_request(req)
                    del self.live[req.req_id]
                    self.finished.append(req.req_id)
        self.clock.now += out.hold_s or STEP_S
        return out


def make_sim(max_num_seqs=4, budget=64, num_blocks=64, lanes=None, options=None, speculative=False) -> Sim:
    clock = FakeClock()
    config = SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=max_num_seqs,
                             lanes=lanes or dict(DEFAULT_LANES), options={"merge_window_s": 0.0, **(options or {})},
                             speculative=speculative)
    return Sim(SLALanesScheduler(config, make_manager(num_blocks, block_size=4), clock=clock), clock)


# -- properties ----------------------------------------------------------------------------------------------------

arrivals = st.lists(st.tuples(st.integers(0, 40), st.sampled_from(LANE_NAMES), st.integers(1, 24),
                              st.integers(1, 12)), min_size=1, max_size=30)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(arrivals, st.integers(1, 5), st.integers(4, 48), st.integers(10, 80))
def test_budget_aging_and_no_drop(workload, max_num_seqs, budget, num_blocks):
    """Never over the token budget, nothing dropped (preempted requests come back and finish), and a request past
    its lane's aging bound is never passed over by a fresher one."""
    lanes = parse_lanes({"realtime": {"max_wait_s": 0.5}, "standard": {"max_wait_s": 1.0},
                         "bulk": {"max_wait_s": 1.5}})
    sim = make_sim(max_num_seqs, budget, num_blocks, lanes)
    specs = sorted(enumerate(workload), key=lambda item: item[1][0])

    def overdue(req_id: str) -> bool:
        req = sim.live[req_id]
        return sim.clock.now - sim.arrival[req_id] >= lanes[req.lane].max_wait_s

    def check(out, waiting_before):
        admitted = [r.req_id for r in out.scheduled if r.req_id in waiting_before]
        late = {r for r in waiting_before if overdue(r)}
        if any(r not in late for r in admitted):
            left_behind = late - set(admitted)
            assert not left_behind, f"admitted fresh {admitted} while overdue {left_behind} kept waiting"

    step = 0
    while specs or sim.live:
        while specs and specs[0][1][0] <= step:
            index, (_, lane, prompt_len, max_tokens) = specs.pop(0)
            # Each request must fit the cache alone (block size 4, one block kept spare).
            if -(-(prompt_len + max_tokens) // 4) <= num_blocks - 1:
                sim.add(f"r{index}", lane, prompt_len, max_tokens)
        sim.step(check)
        step += 1
        assert step < 5000, f"stalled with {len(sim.live)} unfinished"
    assert sorted(sim.finished) == sorted(set(sim.finished))
    for req_id in sim.preempted:
        assert req_id in sim.finished


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(st.integers(0, 40), st.sampled_from(["standard", "bulk"]), st.integers(1, 16),
                          st.integers(1, 8)), max_size=16), st.integers(1, 4))
def test_no_lane_starves_past_its_aging_bound_under_realtime_pressure(others, max_num_seqs):
    """A realtime request arrives every step for 60 steps, enough to keep every slot busy; each standard or bulk
    request still starts within its aging bound plus one request's length per older request it may queue behind."""
    lanes = parse_lanes({"realtime": {"max_wait_s": 100.0}, "standard": {"max_wait_s": 0.5},
                         "bulk": {"max_wait_s": 1.0}})
    # Brownout and predicted-wait refusals would turn requests away; this is about those admitted.
    sim = make_sim(max_num_seqs, budget=64, num_blocks=400, lanes=lanes, options={"brownout": {"enabled": False}})
    sim.scheduler.step_time.min_samples = 10**9
    longest_steps = 1 + 8  # a prompt fits one step (budget 64 >= 16 + decodes), then at most 8 tokens
    arrivals = sorted((step, i, lane, p, m) for i, (step, lane, p, m) in enumerate(others))
    older: dict[str, int] = {}
    step = 0
    while step < 60 or sim.live:
        if step < 60:
            sim.add(f"rt{step}", "realtime", 4, 2)
        while arrivals and arrivals[0][0] <= step:
            _, i, lane, prompt_len, max_tokens = arrivals.pop(0)
            num_older = len(older)
            assert sim.add(f"o{i}", lane, prompt_len, max_tokens)
            older[f"o{i}"] = num_older
        sim.step()
        step += 1
        assert step < 3000
    for name, num_older in older.items():
        lane = "standard" if any(n == name and ln == "standard" for n, ln in
                                 ((f"o{i}", o[1]) for i, o in enumerate(others))) else "bulk"
        bound = lanes[lane].max_wait_s + (num_older + 1) * longest_steps * STEP_S + STEP_S
        waited = sim.first_scheduled[name] - sim.arrival[name]
        assert waited <= bound + 1e-9, f"{name} ({lane}) waited {waited:.2f}s, bound {bound:.2f}s"


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.floats(0, 3), st.floats(0.05, 2.0)), min_size=1, max_size=200))
def test_brownout_hysteresis(samples):
    """Whatever the pressure does, the level moves one step at a time, never faster than the hold times, up only
    after enter_after_s at or above enter_pressure and down only after exit_after_s below exit_pressure."""
    config = BrownoutConfig(enter_after_s=1.0, exit_after_s=3.0)
    controller = BrownoutController(config)
    now, history = 0.0, []
    for pressure, dt in samples:
        now += dt
        history.append((now, pressure))
        before = controller.level
        changed = controller.update(now, pressure, "test")
        if changed is None:
            assert controller.level == before
            continue
        assert abs(changed - before) == 1
        hold = config.enter_after_s if changed > before else config.exit_after_s
        window = [p for t, p in history if t >= now - hold]
        if changed > before:
            assert all(p >= config.enter_pressure for p in window)
        else:
            assert all(p < config.exit_pressure for p in window)
    times = [t for t, _, _ in controller.transitions]
    assert all(b - a >= config.enter_after_s for a, b in zip(times, times[1:]))


def test_brownout_exit_hold_backs_off_when_it_flaps():
    config = BrownoutConfig(enter_after_s=1.0, exit_after_s=2.0)
    controller = BrownoutController(config)
    now = 0.0

    def feed(pressure, seconds):
        nonlocal now
        for _ in range(int(seconds * 10)):
            now += 0.1
            controller.update(now, pressure, "test")

    feed(2.0, 1.5)
    assert controller.level == 1
    feed(0.1, 2.5)
    assert controller.level == 0 and controller.exit_hold_s == 2.0
    feed(2.0, 1.5)  # right back up: the load only fits while shed
    assert controller.level == 1 and controller.exit_hold_s == 4.0
    feed(0.1, 3.0)
    assert controller.level == 1  # the longer hold keeps it there
    feed(0.1, 1.5)
    assert controller.level == 0
    feed(0.1, 20.0)  # a calm spell forgets the flapping
    assert controller.exit_hold_s == 2.0


def test_brownout_leaves_at_the_base_hold_once_the_engine_is_idle():
    """A load that flapped grows the exit hold; once the engine has drained, each level is left after the base
    hold, not the grown one (a drained server must not go on shedding)."""
    config = BrownoutConfig(enter_after_s=1.0, exit_after_s=2.0, max_level=3)
    controller = BrownoutController(config)
    now = 0.0

    def feed(pressure, seconds, idle=False):
        nonlocal now
        for _ in range(int(seconds * 10)):
            now += 0.1
            controller.update(now, pressure, "test", idle=idle)

    feed(2.0, 1.5)
    feed(0.1, 2.5)
    feed(2.0, 3.5)  # flapped, then climbed to the top
    assert controller.level == 3 and controller.exit_hold_s == 4.0
    feed(0.1, 3.0)  # still busy: the grown hold applies
    assert controller.level == 3
    feed(0.0, 3 * 2.0 + 0.5, idle=True)
    assert controller.level == 0


# -- behaviour -----------------------------------------------------------------------------------------------------


def test_realtime_preempts_bulk_when_full():
    sim = make_sim(max_num_seqs=2)
    sim.add("bulk-1", "bulk", 8, 50)
    sim.add("bulk-2", "bulk", 8, 50)
    sim.step()
    sim.step()
    assert sim.scheduler.num_running == 2
    sim.add("rt", "realtime", 8, 4)
    out = sim.step()
    assert "rt" in [r.req_id for r in out.scheduled]
    assert [r.req_id for r in out.preempted] == ["bulk-2"]  # the youngest bulk goes
    while sim.live:
        sim.step()
    assert sim.finished.index("rt") < sim.finished.index("bulk-2")


def test_standard_does_not_preempt_and_waits_its_turn():
    sim = make_sim(max_num_seqs=1)
    sim.add("bulk", "bulk", 8, 10)
    sim.step()
    sim.add("std", "standard", 8, 4)
    out = sim.step()
    assert not out.preempted and [r.req_id for r in out.scheduled] == ["bulk"]
    while sim.live:
        sim.step()
    assert sim.finished == ["bulk", "std"]


def test_aged_bulk_goes_before_fresh_realtime():
    lanes = parse_lanes({"bulk": {"max_wait_s": 0.3}})
    sim = make_sim(max_num_seqs=1, lanes=lanes)
    sim.add("rt-0", "realtime", 4, 3)
    sim.add("bulk", "bulk", 4, 2)
    order = []
    for i in range(1, 40):  # a realtime request arrives every step: without aging bulk would never run
        sim.add(f"rt-{i}", "realtime", 4, 3)
        out = sim.step()
        order += [r.req_id for r in out.scheduled if r.req_id not in order]
    assert "bulk" in order
    waited = sim.first_scheduled["bulk"] - sim.arrival["bulk"]
    # Aging bound plus one running request's length (3 tokens + prefill: 4 steps).
    assert waited <= 0.3 + 5 * STEP_S


def test_queue_full_is_refused_with_retry_after():
    lanes = parse_lanes({"bulk": {"max_queue": 2}})
    sim = make_sim(max_num_seqs=1, lanes=lanes)
    assert sim.add("a", "bulk", 8, 4) and sim.add("b", "bulk", 8, 4)
    assert not sim.add("c", "bulk", 8, 4)
    refusal = sim.refused[-1]
    assert refusal.reason == "queue_full" and refusal.retry_after_s >= 1 and "bulk" in str(refusal)
    assert sim.add("d", "realtime", 8, 4)  # other lanes have their own queues


def test_predicted_wait_refuses_only_the_lane_that_would_miss():
    lanes = parse_lanes({"realtime": {"ttft_target_s": 0.5}, "standard": {"ttft_target_s": 1.0}})
    sim = make_sim(max_num_seqs=8, budget=32, num_blocks=400, lanes=lanes)
    # Teach the step-time model: back-to-back steps of STEP_S each.
    for i in range(8):
        sim.add(f"warm-{i}", "standard", 30, 20)
    for _ in range(12):
        sim.step()
    assert sim.scheduler.step_time.ready
    # A long standard backlog: 40 requests of 64 prompt tokens at 32 tokens per step is about 80 steps (4 s).
    accepted = sum(sim.add(f"s{i}", "standard", 64, 4) for i in range(40))
    assert accepted < 40
    refusal = sim.refused[-1]
    assert refusal.reason == "predicted_wait" and refusal.retry_after_s >= 1
    assert "standard" in str(refusal) and "target" in str(refusal)
    # The backlog is standard's: a realtime request is not behind it, so it is still admitted.
    assert sim.add("rt", "realtime", 8, 4)


def test_merge_window_holds_idle_arrivals_briefly():
    sim = make_sim(options={"merge_window_s": 0.01})
    sim.add("a", "standard", 8, 2)
    out = sim.scheduler.schedule()
    assert out.is_empty and 0 < out.hold_s <= 0.01
    sim.clock.now += 0.011
    out = sim.scheduler.schedule()
    assert [r.req_id for r in out.scheduled] == ["a"]


def test_merge_window_is_bounded_by_the_tightest_deadline():
    # The realtime target is shorter than the window: the hold spends at most a tenth of it.
    lanes = parse_lanes({"realtime": {"ttft_target_s": 0.005}})
    sim = make_sim(lanes=lanes, options={"merge_window_s": 0.05})
    sim.add("std", "standard", 8, 2)
    sim.add("rt", "realtime", 8, 2)
    out = sim.scheduler.schedule()
    assert out.is_empty and 0 < out.hold_s <= 0.0005
    sim.clock.now += out.hold_s
    out = sim.scheduler.schedule()
    assert [r.req_id for r in out.scheduled] == ["rt", "std"]


def test_brownout_ladder_sheds_caps_shrinks_and_pauses_speculation():
    sim = make_sim(max_num_seqs=4, budget=256, num_blocks=400, speculative=True,
                   options={"brownout": {"enter_after_s": 0.0, "interval_s": 0.0, "bulk_max_tokens": 5,
                                         "prefill_chunk": 16}})
    scheduler = sim.scheduler
    sim.add("bulk-running", "bulk", 8, 100)
    sim.step()
    for _ in range(1, len(STEPS) + 1):
        scheduler.brownout.update(sim.clock.now, 5.0, "test")
        sim.clock.now += 1.0
    assert scheduler.brownout.level == len(STEPS)
    scheduler._update_brownout(sim.clock.now)  # applies the cap to running bulk work
    assert scheduler.status().brownout_steps == STEPS
    assert not scheduler.allows_speculation()
    plain = make_sim(options={"brownout": {"enter_after_s": 0.0, "interval_s": 0.0}}).scheduler
    for _ in range(len(STEPS) + 1):
        plain.brownout.update(sim.clock.now, 5.0, "test")
        sim.clock.now += 1.0
    assert plain.brownout.level == len(STEPS) - 1  # without a proposer there is no speculation to pause
    assert not sim.add("bulk-new", "bulk", 8, 4) and sim.refused[-1].reason == "brownout"
    assert sim.refused[-1].retry_after_s >= 1
    assert sim.add("std-new", "standard", 8, 4)  # standard is left to admission control
    assert sim.add("rt", "realtime", 100, 4)
    bulk = next(r for r in sim.live.values() if r.req_id == "bulk-running")
    assert bulk.params.max_tokens <= 5
    out = sim.step()
    prefill = {r.req_id: n for r, n in zip(out.scheduled, out.num_scheduled_tokens) if n > 1}
    assert prefill == {"rt": 16}  # the chunk cap: realtime's prompt first, nothing left for std-new this step


def test_step_time_model_learns_a_line():
    model = StepTimeModel(forget=0.02)
    for i in range(200):
        tokens = 1 + (i * 37) % 300
        model.observe(tokens, 0.01 + 0.0002 * tokens)
    base, per_token = model.coefficients()
    assert base == pytest.approx(0.01, rel=0.02) and per_token == pytest.approx(0.0002, rel=0.02)


def test_fcfs_warns_of_the_sla_lanes_options_it_ignores(caplog):
    from rtx_plugins.schedulers.fcfs import FCFSScheduler

    FCFSScheduler(SchedulerConfig(options={"brownout": {"enter_pressure": 2.0}}), make_manager(16))
    assert "fcfs scheduler ignores the options brownout" in caplog.text


def test_bad_options_are_config_errors():
    with pytest.raises(ConfigError, match="unknown sla-lanes option 'merge_window'"):
        make_sim(options={"merge_window": 1})
    with pytest.raises(ConfigError, match="exit_pressure"):
        make_sim(options={"brownout": {"exit_pressure": 2.0}})
    # Each value of the wrong type names its key, rather than a TypeError from a comparison or a truthy "no".
    for key, value, wanted in (("enter_pressure", "high", "a number"), ("enabled", "no", "true or false"),
                               ("enter_after_s", True, "a number"), ("prefill_chunk", "big", "an integer"),
                               ("interval_s", [1], "a number"), ("exit_after_s", float("nan"), "a number")):
        with pytest.raises(ConfigError, match=rf"\[brownout\] {key} must be {wanted}"):
            make_sim(options={"brownout": {key: value}})
    with pytest.raises(ConfigError, match="merge_window_s must be a number of seconds"):
        make_sim(options={"merge_window_s": "x"})
    with pytest.raises(ConfigError, match="brownout must be a table"):
        make_sim(options={"brownout": 5})
    with pytest.raises(ConfigError, match="unknown lane 'gold'"):
        parse_lanes({"gold": {}})
    with pytest.raises(ConfigError, match="may only preempt lanes below it"):
        parse_lanes({"bulk": {"preempts": ["realtime"]}})
    with pytest.raises(ConfigError, match="preempts must be a list of lane names"):
        parse_lanes({"realtime": {"preempts": "bulk"}})
    with pytest.raises(ConfigError, match="ttft_target_s must be a positive number"):
        parse_lanes({"realtime": {"ttft_target_s": float("inf")}})
