"""The queueing model: a discrete-event simulation of the engine under a given arrival process.

No closed form covers what decides latency here (chunked prefill sharing steps with decodes, lane priorities,
admission on predicted waits, preemption, brownout), so the model runs the real code: an engine with the real
scheduler plugin and KV-cache manager, on a small stand-in model (``dummy:tiny``: which tokens come out does not
matter, only how many), whose steps take the time the step-time profile says instead of the time they take here.
The scheduler reads that virtual clock, so its admission, aging and brownout decisions are the ones the real server
would make at those times. A request arriving during a step joins at its end, as the server's inbox does; an empty
step that holds for a merge window waits that long or until the next arrival. With a profile that has a spread (one
a live server learnt), each step's time is the profile's line times a ratio drawn from it, so the tails that real
steps' variation makes (a step slowed by the serving threads, a collector pause) are in the prediction too. With a
profile that knows the serving path (rtxcore.capacity.serving_path), each request reaches the engine an ingress after
its arrival and its first token counts a delivery later, both drawn from what the live server measured.

Each simulated second costs a few milliseconds of host time per step (the stand-in model's forward pass and the
engine's own work), so an hour of traffic at a few steps a second simulates in well under a minute.
"""

from __future__ import annotations

import logging
import math
import random
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace

from rtxcore.bench.loadgen.workload import LaneProfile, PlannedRequest
from rtxcore.capacity.profile import StepTimeProfile
from rtxcore.engine.config import EngineConfig
from rtxcore.errors import AdmissionRefused, ConfigError, InvalidRequestError
from rtxcore.sampling_params import SamplingParams

STAND_IN_MODEL = "dummy:tiny"
# Steps in a row that scheduled nothing while requests wait, and no merge window or arrival explains it (the engine
# would wait forever: a request that can never fit).
_MAX_STALLED_STEPS = 10_000


@dataclass(frozen=True, slots=True)
class Arrival:
    time_s: float
    lane: str
    prompt_tokens: int
    output_tokens: int


def poisson_arrivals(rate: float, duration_s: float, mix: Sequence[LaneProfile], seed: int = 0) -> list[Arrival]:
    """Poisson arrivals at ``rate`` a second for ``duration_s``, each one's lane drawn by weight and its lengths
    from the lane's ranges (``rtx loadgen``'s lane profiles)."""
    rng = random.Random(seed)
    weights = [m.weight for m in mix]
    out: list[Arrival] = []
    t = 0.0
    while True:
        t += rng.expovariate(rate)
        if t >= duration_s:
            return out
        m = rng.choices(mix, weights)[0]
        out.append(Arrival(t, m.name, m.prompt_tokens.sample(rng), m.output_tokens.sample(rng)))


def arrivals_of(plan: Iterable[PlannedRequest]) -> list[Arrival]:
    """The arrivals of an ``rtx loadgen`` load phase (``plan_requests``: the same seed, the same plan), so that the
    model can be run on exactly the requests a live run sent."""
    return [Arrival(p.send_at_s, p.lane, p.num_prompt_tokens, p.max_tokens) for p in plan]


@dataclass(slots=True)
class LaneOutcome:
    ttft_s: list[float] = field(default_factory=list)
    itl_s: list[float] = field(default_factory=list)
    refused: int = 0
    finished: int = 0


@dataclass(slots=True)
class SimulationResult:
    lanes: dict[str, LaneOutcome]
    duration_s: float
    steps: int
    busy_s: float
    # Time-weighted mean of requests waiting (queued, not running) and running.
    mean_waiting: float
    mean_running: float

    @property
    def utilization(self) -> float:
        """Share of the time the engine was stepping."""
        return self.busy_s / self.duration_s if self.duration_s > 0 else 0.0


def count_scheduled_tokens(engine) -> list[int]:
    """A two-item list that holds, after each ``engine.step()``, the tokens that step's schedule computed and the
    requests it computed them for: the engine's scheduler is wrapped to read them (what a step's time depends on)."""
    scheduled = [0, 0]
    schedule = engine.core.scheduler.schedule

    def counting_schedule():
        out = schedule()
        scheduled[0], scheduled[1] = out.total_num_scheduled_tokens, len(out.scheduled)
        return out
    engine.core.scheduler.schedule = counting_schedule
    return scheduled


def engine_config_for(served: EngineConfig) -> EngineConfig:
    """The stand-in engine: the served engine's scheduler, lanes, budgets and KV block count, on ``dummy:tiny``
    run serially (a step's time is the profile's, so overlapping the host's work with the device's is in it)."""
    if served.num_kv_blocks is None:
        raise ValueError("the simulation needs the served engine's KV block count (num_kv_blocks)")
    return replace(served, model=STAND_IN_MODEL, backend="torch", device="cpu", dtype="float32", quantization=None,
                   tensor_parallel_size=1, pipeline_parallel_size=1, async_scheduling=False, enforce_eager=True,
                   kv_host_bytes=0, kv_disk_dir=None, max_model_len=None, kv_cache_bytes=None,
                   enable_prefix_caching=False, kv_cache_dtype="auto")


def simulate(served: EngineConfig, profile: StepTimeProfile, arrivals: Iterable[Arrival],
             seed: int = 0) -> SimulationResult:
    """Run ``arrivals`` through the stand-in of ``served`` on the virtual clock; every request to its end. ``seed``
    draws the steps' times from the profile's spread."""
    from rtxcore.engine.llm import LLM

    # The scheduler's brownout changes are logged as the live server's are; here they are the model's, not news.
    brownout_log = logging.getLogger("rtx.brownout")
    level = brownout_log.level
    brownout_log.setLevel(logging.ERROR)
    try:
        return _run(LLM(engine_config_for(served)), profile, arrivals, random.Random(seed),
                    random.Random(f"serving path {seed}"))
    finally:
        brownout_log.setLevel(level)


def _run(engine, profile: StepTimeProfile, arrivals: Iterable[Arrival], rng: random.Random,
         path_rng: random.Random) -> SimulationResult:
    core = engine.core
    now = 0.0
    if hasattr(core.scheduler, "clock"):
        core.scheduler.clock = lambda: now
    scheduled = count_scheduled_tokens(engine)

    # Each request reaches the engine after its ingress, and its first token reaches the serving side a delivery
    # later (both drawn from the profile's serving path; none without one): the clock of its TTFT is its arrival's.
    queue: list[tuple[float, Arrival, float]] = []
    for a in arrivals:
        ingress, delivery = profile.draw_serving_path(path_rng.random(), path_rng.random()) \
            if profile.ingress or profile.delivery else (0.0, 0.0)
        queue.append((a.time_s + ingress, a, delivery))
    queue.sort(key=lambda entry: entry[0])
    lanes: dict[str, LaneOutcome] = {}
    live: dict[str, tuple[str, float, float | None, float]] = {}  # req id -> (lane, arrival, last token, delivery)
    steps, busy, waiting_area, running_area, start = 0, 0.0, 0.0, 0.0, queue[0][0] if queue else 0.0
    index = stalled = 0
    while index < len(queue) or engine.has_unfinished_requests():
        if not engine.has_unfinished_requests() and queue[index][0] > now:
            now = queue[index][0]  # idle until the next arrival
        while index < len(queue) and queue[index][0] <= now:
            _, a, delivery = queue[index]
            index += 1
            outcome = lanes.setdefault(a.lane, LaneOutcome())
            params = SamplingParams(max_tokens=a.output_tokens, temperature=0.0, ignore_eos=True)
            try:
                req_id = engine.add_request([1 + (index + i) % 97 for i in range(a.prompt_tokens)], params,
                                            lane=a.lane)
            except AdmissionRefused:
                outcome.refused += 1
                continue
            except InvalidRequestError as exc:  # e.g. longer than the stand-in model's context
                raise ConfigError(f"the simulation cannot take a {a.lane} request of {a.prompt_tokens} prompt and "
                                  f"{a.output_tokens} output tokens: {exc}") from None
            live[req_id] = (a.lane, a.time_s, None, delivery)
        outputs = engine.step()
        if not scheduled[0]:
            # Nothing ran: a merge-window hold (until it ends or the next arrival), or an empty step (the loop
            # around it costs about a step's fixed part).
            gap = max((queue[index][0] if index < len(queue) else math.inf) - now, 0.0)
            seconds = min(core.hold_s, gap) if core.hold_s > 0 else min(gap, max(profile.base_s, 1e-4))
            stalled += 1
            if stalled > _MAX_STALLED_STEPS:
                raise ConfigError(f"{engine.core.scheduler.num_waiting} requests can never be scheduled: the KV cache "
                                  f"({engine.core.kv_cache.pool.num_usable_blocks} blocks) or the step budget is "
                                  "too small for them")
        else:
            seconds = profile.draw(scheduled[0], rng.random(), scheduled[1])
            stalled = 0
            steps += 1
            busy += seconds
        waiting_area += core.scheduler.num_waiting * seconds
        running_area += core.scheduler.num_running * seconds
        now += seconds
        for out in outputs:
            if out.req_id not in live:
                continue
            lane, arrived, last, delivery = live[out.req_id]
            outcome = lanes[lane]
            if out.new_token_ids:
                if last is None:
                    outcome.ttft_s.append(now + delivery - arrived)
                else:
                    outcome.itl_s.append(now - last)
                live[out.req_id] = (lane, arrived, now, delivery)
            if out.finished:
                outcome.finished += 1
                del live[out.req_id]
    duration = max(now - start, 1e-9)
    return SimulationResult(lanes, duration, steps, busy, waiting_area / duration, running_area / duration)
