"""``rtx plan``'s arithmetic: predictions at given arrival rates (rtxcore.capacity.simulation), each lane's capacity
(the arrival rate at which its p95 time to first token first exceeds its target), the replicas a target rate needs
and the autoscaling thresholds that go with them."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from rtxcore.bench.loadgen.stats import percentile
from rtxcore.bench.loadgen.workload import LaneProfile
from rtxcore.capacity.profile import StepTimeProfile
from rtxcore.capacity.simulation import SimulationResult, poisson_arrivals, simulate
from rtxcore.engine.config import EngineConfig

# Replicas are sized so that each runs at this share of its capacity: room for bursts and for a pod restarting.
HEADROOM = 0.8
# A lane that has this share of its requests refused has missed its target as surely as one served late.
MAX_REFUSED_SHARE = 0.01
# Bisection steps of a lane's capacity: the interval shrinks to 1/64 of the first bracket, finer than the noise of
# a few thousand simulated arrivals.
_SEARCH_STEPS = 6
# Arrivals of the light-load runs that find the rate the engine saturates at (a utilisation needs few).
_PROBE_REQUESTS = 100


@dataclass(slots=True)
class LanePrediction:
    ttft_s: dict[str, float | None]
    itl_s: dict[str, float | None]
    refused: int
    finished: int

    def to_json(self) -> dict[str, Any]:
        return {"ttft_s": self.ttft_s, "itl_s": self.itl_s, "refused": self.refused, "finished": self.finished}


@dataclass(slots=True)
class Prediction:
    rate: float
    lanes: dict[str, LanePrediction]
    utilization: float
    mean_waiting: float
    mean_running: float

    def to_json(self) -> dict[str, Any]:
        return {"rate": self.rate, "utilization": self.utilization, "mean_waiting": self.mean_waiting,
                "mean_running": self.mean_running, "lanes": {k: v.to_json() for k, v in self.lanes.items()}}


# The percentiles a prediction gives, by name.
PERCENTILES = {"p50": 50, "p95": 95, "p99": 99}


def _quantiles(values: list[float]) -> dict[str, float | None]:
    # rtx loadgen's percentiles, so that predicted and measured figures are computed alike.
    return {name: percentile(values, q) for name, q in PERCENTILES.items()}


def summarize(rate: float, result: SimulationResult) -> Prediction:
    lanes = {name: LanePrediction(_quantiles(o.ttft_s), _quantiles(o.itl_s), o.refused, o.finished)
             for name, o in sorted(result.lanes.items())}
    return Prediction(rate, lanes, result.utilization, result.mean_waiting, result.mean_running)


@dataclass(slots=True)
class WindowRange:
    """What one window of ``window_s`` seconds at a rate can show: each lane's figures, least and most over ``count``
    Poisson sequences of that length. A tail figure of a lane near its own saturation moves a lot between windows
    (and a prediction over many arrivals holds rarer bursts than one window does), so a measured window is judged,
    and an alert threshold set, against this range rather than one number."""
    window_s: float
    count: int
    lanes: dict[str, dict[str, dict[str, tuple[float, float]]]]  # lane -> "ttft_s"/"itl_s" -> "p95" -> (min, max)

    def to_json(self) -> dict[str, Any]:
        return {"window_s": self.window_s, "count": self.count,
                "lanes": {lane: {key: {q: list(r) for q, r in figures.items()} for key, figures in f.items()}
                          for lane, f in self.lanes.items()}}


def window_ranges(predictions: Sequence[Prediction], window_s: float) -> WindowRange:
    """Each lane's percentiles, least and most over ``predictions`` (one per window); a lane or percentile no window
    had a sample for is left out."""
    lanes: dict[str, dict[str, dict[str, tuple[float, float]]]] = {}
    for name in sorted({lane for p in predictions for lane in p.lanes}):
        lanes[name] = {}
        for key in ("ttft_s", "itl_s"):
            lanes[name][key] = {}
            for q in PERCENTILES:
                drawn = [v for p in predictions if name in p.lanes
                         and (v := getattr(p.lanes[name], key)[q]) is not None]
                if drawn:
                    lanes[name][key][q] = (min(drawn), max(drawn))
    return WindowRange(window_s, len(predictions), lanes)


@dataclass(slots=True)
class Planner:
    served: EngineConfig
    profile: StepTimeProfile
    mix: Sequence[LaneProfile]
    # Arrivals per prediction rather than simulated seconds: a simulation costs about the same for any rate, so a
    # fast engine (high capacity) is planned as quickly as a slow one.
    requests: int = 3000
    seed: int = 0
    log: Callable[[str], None] = lambda line: None
    _cache: dict[float, Prediction] = field(default_factory=dict)

    def predict(self, rate: float) -> Prediction:
        rate = round(rate, 6)
        if rate not in self._cache:
            arrivals = poisson_arrivals(rate, self.requests / rate, self.mix, self.seed)
            self._cache[rate] = summarize(rate, simulate(self.served, self.profile, arrivals, self.seed))
        return self._cache[rate]

    def windows(self, rate: float, window_s: float, count: int) -> WindowRange:
        """Each figure's range over ``count`` other Poisson sequences at ``rate``, each ``window_s`` long."""
        predictions = [summarize(rate, simulate(self.served, self.profile,
                                                poisson_arrivals(rate, window_s, self.mix, self.seed + 100 + k),
                                                self.seed + k))
                       for k in range(count)]
        return window_ranges(predictions, window_s)

    def target(self, lane: str) -> float:
        return self.served.scheduling.lanes[lane].ttft_target_s

    def misses(self, lane: str, rate: float) -> bool:
        """Whether the lane's p95 TTFT at ``rate`` is over its target, or the scheduler refuses more than
        ``MAX_REFUSED_SHARE`` of its requests (admission control keeps p95 on target by refusing)."""
        p = self.predict(rate).lanes.get(lane)
        if p is None:
            return False
        p95 = p.ttft_s["p95"]
        refused = p.refused / max(p.refused + p.finished, 1)
        return refused > MAX_REFUSED_SHARE or (p95 is not None and p95 > self.target(lane))

    def saturation_rate(self) -> float:
        """Arrivals a second the engine could serve at full utilisation, from a light-load run's utilisation."""
        probe = 0.05
        while True:
            arrivals = poisson_arrivals(probe, _PROBE_REQUESTS / probe, self.mix, self.seed)
            utilization = simulate(self.served, self.profile, arrivals, self.seed).utilization
            if utilization > 0.02 or probe > 1e4:
                return probe / max(utilization, 1e-6)
            probe *= 4

    def capacity(self, lane: str) -> float:
        """The lowest rate (to 1/256 of the search bracket) at which ``lane`` misses its target."""
        high = 1.5 * self.saturation_rate()
        while not self.misses(lane, high):
            high *= 2
            if high > 1e6:
                return math.inf
        low = 0.0
        for _ in range(_SEARCH_STEPS):
            mid = (low + high) / 2
            if self.misses(lane, mid):
                high = mid
            else:
                low = mid
        self.log(f"lane {lane}: target first missed near {high:.3g} requests/s")
        return high


def replicas_for(target_rate: float, capacity: float) -> int:
    return max(1, math.ceil(target_rate / (capacity * HEADROOM)))
