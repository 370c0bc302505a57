"""The gates that load a live server: latency (W5-style open-loop load at half the measured capacity: each lane's p99
time to first token and the standard lane's p99 inter-token latency within the lane's target, no errors) and
overload (1.5x capacity: nothing lost, no 5xx, every refusal a 429 with Retry-After).

Both run against one ``rtx serve`` of the default model with the sla-lanes scheduler and the lane targets of
``[phase.latency]``, after one capacity measurement (closed-loop clients, steady state only)."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from rtxcore.bench.loadgen import (
    LaneProfile,
    LengthRange,
    LoadgenConfig,
    LoadgenReport,
    Outcome,
    measure_capacity,
    run_loadgen,
)
from rtxcore.bench.loadgen.workload import MAX_CONNECTIONS
from rtxcore.errors import ConfigError
from rtxcore.gates.outcome import Check
from rtxcore.gates.restart import ReliabilitySettings
from rtxcore.gates.served import ServedProcess
from rtxcore.gates.thresholds import require

# What the gate holds to its targets: (lane, quantity, index of the quantity in the lane's [ttft_s, itl_s] target).
CHECKS = (("realtime", "ttft", 0), ("standard", "ttft", 0), ("standard", "itl", 1))


@dataclass(frozen=True, slots=True)
class LatencySettings:
    load: float
    duration_s: float
    capacity_clients: int
    capacity_duration_s: float
    # lane -> [weight, prompt low, prompt high, output low, output high]
    lanes: dict[str, list[float]]
    # lane -> [ttft target s, itl target s]: the SLA the server runs with.
    targets: dict[str, list[float]]
    serve_args: list[str] = field(default_factory=list)
    seed: int = 1

    def __post_init__(self) -> None:
        for key in ("load", "duration_s", "capacity_duration_s"):
            require(getattr(self, key) > 0, key, "> 0", getattr(self, key))
        require(1 <= self.capacity_clients <= MAX_CONNECTIONS, "capacity_clients", f"from 1 to {MAX_CONNECTIONS:,}",
                self.capacity_clients)
        require(bool(self.lanes), "lanes", "a table of at least one lane", self.lanes)
        self.profiles()
        for lane, target in self.targets.items():
            require(len(target) == 2 and all(t > 0 for t in target), f"targets.{lane}", "[ttft_s, itl_s], both > 0",
                    target)
        missing = [lane for lane in (*self.lanes, *(lane for lane, _, _ in CHECKS)) if lane not in self.targets]
        if missing:
            raise ConfigError(f"targets has no lane {missing[0]}: give it [ttft_s, itl_s]")

    def profiles(self) -> tuple[LaneProfile, ...]:
        """The lane mix as the load sends it.

        :raises ConfigError: a lane's weight or lengths, naming it.
        """
        profiles = []
        for name, value in self.lanes.items():
            require(len(value) == 5 and all(float(x).is_integer() for x in value[1:]), f"lanes.{name}",
                    "[weight, prompt low, prompt high, output low, output high], the lengths whole numbers", value)
            weight, p0, p1, o0, o1 = value
            try:
                profiles.append(LaneProfile(name, weight, LengthRange(int(p0), int(p1)),
                                            LengthRange(int(o0), int(o1))))
            except ConfigError as exc:
                raise ConfigError(f"lanes.{name}: {exc}") from None
        return tuple(profiles)


def run(latency: LatencySettings, overload: ReliabilitySettings | None, workdir: Path, say) -> list[Check]:
    config_file = workdir / "lanes.toml"
    config_file.write_text("".join(f"[lanes.{lane}]\nttft_target_s = {ttft}\nitl_target_s = {itl}\n\n"
                                   for lane, (ttft, itl) in latency.targets.items()))
    lanes = latency.profiles()
    say("latency: starting rtx serve (sla-lanes) on the default model...")
    with ServedProcess(["--scheduler", "sla-lanes", "--config", str(config_file), *latency.serve_args],
                       workdir / "online-server.log") as server:
        base = LoadgenConfig(url=server.base_url, lanes=lanes, seed=latency.seed,
                             capacity_clients=latency.capacity_clients,
                             capacity_duration_s=latency.capacity_duration_s)
        _warm_up(server.base_url, lanes)
        say(f"latency: measuring capacity ({latency.capacity_clients} closed-loop clients, "
            f"{latency.capacity_duration_s:g} s)...")
        capacity = asyncio.run(measure_capacity(base)).requests_per_s
        say(f"latency: capacity {capacity:.3g} req/s; {latency.load:g}x for {latency.duration_s:g} s...")
        report = asyncio.run(run_loadgen(_phase(base, capacity, latency.load, latency.duration_s)))
        checks = latency_checks(report, latency)
        if overload is not None:
            say(f"reliability: overload at {overload.overload:g}x capacity for {overload.overload_duration_s:g} s...")
            checks += overload_checks(asyncio.run(run_loadgen(_phase(base, capacity, overload.overload,
                                                                     overload.overload_duration_s))))
    return checks


def _warm_up(base_url: str, lanes: tuple[LaneProfile, ...]) -> None:
    """One request of each lane's longest shape first: a fresh server's first steps pay one-time costs (allocations,
    first calls into the kernels) that would otherwise land in the capacity measurement."""
    for lane in lanes:
        body = {"prompt": [100 + i for i in range(lane.prompt_tokens.high)], "max_tokens": lane.output_tokens.high,
                "temperature": 0, "ignore_eos": True}
        for _ in range(10):  # a cold server may refuse a lane it predicts to miss (429): wait as told and retry
            resp = httpx.post(base_url + "/v1/completions", json=body, headers={"x-rtx-lane": lane.name},
                              timeout=600, trust_env=False)
            if resp.status_code != 429:
                break
            time.sleep(float(resp.headers.get("retry-after", 1)))


def _phase(base: LoadgenConfig, capacity: float, load: float, duration_s: float) -> LoadgenConfig:
    return LoadgenConfig(url=base.url, lanes=base.lanes, seed=base.seed, capacity=capacity, load=load,
                         duration_s=duration_s, request_timeout_s=max(120.0, 4 * duration_s))


def latency_checks(report: LoadgenReport, settings: LatencySettings) -> list[Check]:
    by_lane = {s.name: s for s in report.lanes}
    checks = []
    for lane, quantity, index in CHECKS:
        stats = by_lane.get(lane)
        target = settings.targets[lane][index]
        values = (stats.ttft_s if quantity == "ttft" else stats.itl_s) if stats is not None else {}
        p99 = values.get(99)
        detail = (f"p99 {p99:.3g} s against the lane's target {target:g} s over {stats.count(Outcome.COMPLETED)} "
                  f"requests" if p99 is not None and stats is not None else f"no completed {lane} request")
        checks.append(Check("latency", f"{lane} p99 {quantity.upper()} / target", None if p99 is None else
                            p99 / target, 1.0, "<=", detail, skipped=p99 is None))
    overall = report.overall
    errors = overall.num_sent - overall.count(Outcome.COMPLETED)
    checks.append(Check("latency", f"requests not completed at {report.load:g}x capacity", errors, 0, "<=",
                        f"{overall.num_sent} sent at {report.offered_rate:.3g} req/s; "
                        + ", ".join(f"{o.value} {n}" for o, n in overall.num_by_outcome.items() if n)))
    return checks


def overload_checks(report: LoadgenReport) -> list[Check]:
    s = report.overall
    rejected = s.count(Outcome.REJECTED_429)
    summary = (f"{s.num_sent} sent at {report.offered_rate:.3g} req/s: "
               + ", ".join(f"{o.value} {n}" for o, n in s.num_by_outcome.items() if n))
    return [Check("reliability", "overload: 5xx answers", s.count(Outcome.ERROR_5XX), 0, "<=", summary),
            Check("reliability", "overload: requests lost", s.count(Outcome.LOST), 0, "<=", summary),
            Check("reliability", "overload: other errors", s.count(Outcome.ERROR_OTHER), 0, "<=", summary),
            Check("reliability", "overload: 429s without Retry-After", rejected - s.num_retry_after, 0, "<=",
                  f"{rejected} refused")]
