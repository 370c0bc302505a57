"""Per-lane figures of a run (percentiles, goodput) and the report as a table and as JSON."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any

from rtxcore.bench.loadgen.probes import BrownoutSample, LaneTargets, count_level_changes
from rtxcore.bench.loadgen.request import Outcome, RequestResult
from rtxcore.bench.loadgen.stats import percentile, rounded
from rtxcore.bench.loadgen.workload import ArrivalPattern, LaneTarget

_QUANTILES = (50, 95, 99)


@dataclass(slots=True, frozen=True)
class LaneStats:
    name: str
    num_sent: int
    # Request counts by outcome; they add up to num_sent.
    num_by_outcome: dict[Outcome, int]
    num_good: int
    # Of requests that completed; ITL pools every gap of every such request.
    ttft_s: dict[int, float | None]
    itl_s: dict[int, float | None]
    num_completion_tokens: int
    # Of the 429s: how many carried a Retry-After in seconds, and its largest value.
    num_retry_after: int
    max_retry_after_s: float | None
    duration_s: float

    @classmethod
    def from_results(cls, name: str, results: list[RequestResult], targets: dict[str, LaneTarget],
                     duration_s: float) -> LaneStats:
        completed = [r for r in results if r.outcome is Outcome.COMPLETED]
        ttfts = [r.ttft_s for r in completed if r.ttft_s is not None]
        itls = [gap for r in completed for gap in r.itl_s]
        retry = [r.retry_after_s for r in results if r.outcome is Outcome.REJECTED_429 and r.retry_after_s is not None]
        counts = Counter(r.outcome for r in results)
        return cls(
            name, len(results), {o: counts.get(o, 0) for o in Outcome},
            sum(1 for r in completed if r.lane in targets and r.is_good(targets[r.lane])),
            {q: percentile(ttfts, q) for q in _QUANTILES}, {q: percentile(itls, q) for q in _QUANTILES},
            sum(r.completion_tokens for r in completed), len(retry), max(retry) if retry else None, duration_s)

    def count(self, outcome: Outcome) -> int:
        return self.num_by_outcome[outcome]

    @property
    def goodput_fraction(self) -> float:
        return self.num_good / self.num_sent if self.num_sent else 0.0

    @property
    def goodput_rate(self) -> float:
        """Good requests per second of the arrival window."""
        return self.num_good / self.duration_s

    def to_json(self) -> dict[str, Any]:
        return {"sent": self.num_sent, **{o.value: n for o, n in self.num_by_outcome.items()},
                "ttft_s": {f"p{q}": rounded(v) for q, v in self.ttft_s.items()},
                "itl_s": {f"p{q}": rounded(v) for q, v in self.itl_s.items()},
                "good": self.num_good, "goodput_fraction": rounded(self.goodput_fraction),
                "goodput_rps": rounded(self.goodput_rate), "completion_tokens": self.num_completion_tokens,
                "retry_after": {"num_with_header": self.num_retry_after, "max_s": self.max_retry_after_s}}


@dataclass(slots=True)
class LoadgenReport:
    url: str
    pattern: ArrivalPattern
    # Base rate offered (requests/s); a spiky pattern multiplies it inside spikes.
    offered_rate: float
    # The multiple of capacity asked for; None when an absolute rate was.
    load: float | None
    duration_s: float
    seed: int
    # Requests/s: measured, or as given (then ``capacity_measurement`` is None); None with an absolute rate.
    capacity: float | None
    capacity_measurement: CapacityResult | None
    targets: LaneTargets
    lanes: list[LaneStats]
    overall: LaneStats
    brownout: list[BrownoutSample]
    # How late the client sent its requests after their planned times: a busy client machine shows here.
    max_send_lag_s: float
    results: list[RequestResult]

    @property
    def brownout_changes(self) -> int:
        return count_level_changes(self.brownout)

    def to_json(self) -> dict[str, Any]:
        levels = sorted({s.level for s in self.brownout if s.level is not None})
        return {
            "url": self.url, "pattern": self.pattern.to_json(), "offered_rate_rps": self.offered_rate,
            "load": self.load, "duration_s": self.duration_s, "seed": self.seed, "capacity_rps": self.capacity,
            "capacity_measurement": self.capacity_measurement.to_json() if self.capacity_measurement else None,
            "targets": {"source": self.targets.source,
                        "lanes": {k: {"ttft_s": t.ttft_s, "itl_s": t.itl_s} for k, t in self.targets.by_lane.items()}},
            "lanes": {s.name: s.to_json() for s in self.lanes},
            "overall": self.overall.to_json(),
            "brownout": {"samples": [[rounded(s.t_s), s.level] for s in self.brownout], "levels_seen": levels,
                         "num_changes": self.brownout_changes},
            "max_send_lag_s": rounded(self.max_send_lag_s),
            "error_messages": dict(Counter(r.error for r in self.results if r.error).most_common(10)),
            "requests": [r.to_json() for r in self.results],
        }

    def table(self) -> str:
        """The summary as aligned text: one row per lane and one for all."""
        if self.capacity is None:
            rate = f"{self.offered_rate:.3g} req/s"
        else:
            measured = "measured" if self.capacity_measurement else "given"
            rate = f"{self.offered_rate:.3g} req/s = {self.load:g}x capacity {self.capacity:.3g} req/s ({measured})"
        lines = [f"# {self.url}: {self.pattern.describe()} at {rate} for {self.duration_s:g}s, seed {self.seed}"]
        header = (f"{'lane':10} {'sent':>5} {'done':>5} {'429':>5} {'5xx':>4} {'other':>5} {'lost':>4}  "
                  f"{'ttft p50':>8} {'p95':>6} {'p99':>6}  {'itl p50':>7} {'p95':>6} {'p99':>6}  "
                  f"{'good':>5} {'good%':>6} {'good/s':>6}")
        lines.append(header)
        for s in [*self.lanes, self.overall]:
            lines.append(
                f"{s.name:10} {s.num_sent:5} {s.count(Outcome.COMPLETED):5} {s.count(Outcome.REJECTED_429):5} "
                f"{s.count(Outcome.ERROR_5XX):4} {s.count(Outcome.ERROR_OTHER):5} {s.count(Outcome.LOST):4}  "
                f"{_s(s.ttft_s[50]):>8} {_s(s.ttft_s[95]):>6} {_s(s.ttft_s[99]):>6}  "
                f"{_s(s.itl_s[50]):>7} {_s(s.itl_s[95]):>6} {_s(s.itl_s[99]):>6}  "
                f"{s.num_good:5} {100 * s.goodput_fraction:5.1f}% {s.goodput_rate:6.2f}")
        lines.append("times in seconds; goodput: completed within the lane's TTFT target and p95 ITL target")
        if self.overall.count(Outcome.COMPLETED) and self.overall.ttft_s[50] is None:
            lines.append("no completed request streamed text to time: a model without a tokenizer needs logprobs "
                         "(--logprobs)")
        lines.append("targets from " + self.targets.source + ": " + ", ".join(
            f"{k} ttft<={t.ttft_s:g}s itl<={t.itl_s:g}s" for k, t in self.targets.by_lane.items()
            if any(s.name == k for s in self.lanes)))
        levels = [s.level for s in self.brownout if s.level is not None]
        if levels:
            lines.append(f"brownout level: {len(self.brownout)} samples, max {max(levels):g}, "
                         f"{self.brownout_changes} changes")
        else:
            lines.append(f"brownout level: absent from /metrics ({len(self.brownout)} polls)")
        lines.append(f"client send lag: max {self.max_send_lag_s * 1000:.0f} ms")
        return "\n".join(lines)


def _s(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


@dataclass(slots=True, frozen=True)
class CapacityResult:
    requests_per_s: float
    num_clients: int
    num_sent: int
    num_completed: int
    # The steady-state window completions were counted in (the measurement minus its first quarter).
    elapsed_s: float

    def to_json(self) -> dict[str, Any]:
        return {"requests_per_s": self.requests_per_s, "num_clients": self.num_clients, "num_sent": self.num_sent,
                "num_completed": self.num_completed, "elapsed_s": self.elapsed_s}
