"""W5 (online mixed lanes) on this CPU with the default model and the sla-lanes scheduler, short runs of
`rtx loadgen`'s engine against a real server: at 1.5x the measured capacity realtime keeps its TTFT target, bulk
absorbs the refusals, nothing is lost and nothing fails with 5xx; under a spike brownout enters and leaves once.

The longer benchmark runs of the same workload are in docs/benchmarks.md."""

from __future__ import annotations

import time

import httpx
import pytest

from rtxcore.bench.loadgen import (
    LoadgenConfig,
    Outcome,
    SpikyArrivals,
    brownout_level,
    run_loadgen_sync,
)
from tests.helpers.server import start_server
from tests.helpers.w5 import SERVER_ARGS, W5_LANES

# Serial: latency under load against targets in seconds, which a test running beside it would eat into.
pytestmark = pytest.mark.serial


@pytest.fixture(scope="module")
def w5_server():
    server = start_server(*SERVER_ARGS)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def capacity(w5_server):
    report = run_loadgen_sync(LoadgenConfig(url=w5_server.base_url, lanes=W5_LANES, capacity_clients=16,
                                            capacity_duration_s=16, duration_s=1, load=0.1, seed=11))
    assert report.capacity_measurement is not None and report.capacity > 0
    return report.capacity


def _check_every_request_accounted(report) -> None:
    for lane in [*report.lanes, report.overall]:
        assert lane.count(Outcome.LOST) == 0, f"{lane.name}: requests lost (no answer before the timeout)"
        assert lane.count(Outcome.ERROR_5XX) == 0, f"{lane.name}: 5xx answers"
        assert lane.count(Outcome.ERROR_OTHER) == 0, f"{lane.name}: other errors"
        assert lane.count(Outcome.COMPLETED) + lane.count(Outcome.REJECTED_429) == lane.num_sent


def test_w5_at_one_and_a_half_times_capacity(w5_server, capacity):
    report = run_loadgen_sync(LoadgenConfig(url=w5_server.base_url, lanes=W5_LANES, capacity=capacity, load=1.5,
                                            duration_s=45, seed=5))
    print(report.table())
    _check_every_request_accounted(report)
    lanes = {lane.name: lane for lane in report.lanes}
    realtime, bulk = lanes["realtime"], lanes["bulk"]
    assert report.targets.source == "server"
    assert realtime.count(Outcome.COMPLETED) > 0
    # Realtime keeps its target: its median TTFT is within it. (A p99 over the handful of realtime requests of a run
    # is its slowest one, which on a shared 2-core machine is at the mercy of the host.)
    assert realtime.ttft_s[50] <= report.targets.by_lane["realtime"].ttft_s
    refused = {name: lane.count(Outcome.REJECTED_429) for name, lane in lanes.items()}
    assert sum(refused.values()) > 0, "1.5x capacity refused nothing: the load never exceeded what was served"
    assert refused["realtime"] == 0
    assert refused["bulk"] >= refused["standard"], f"refusals {refused}: bulk should absorb them"
    for result in report.results:
        if result.outcome is Outcome.REJECTED_429:
            assert result.retry_after_s is not None and result.retry_after_s >= 1
    assert bulk.count(Outcome.COMPLETED) > 0  # bulk is throttled, not starved


def test_brownout_enters_under_a_spike_and_leaves_once(w5_server, capacity):
    # Start from normal service: the previous test's overload may still hold a brownout level.
    assert _wait_for_brownout_level_zero(w5_server.base_url, 90)[-1:] == [0], "brownout never left before the spike"
    # Half of capacity, then 10x capacity for 8 s, then half again: one spike. W5's spikes are 3x for 10 s (the
    # benchmark runs those); whether 3x overloads the protected lanes within a short run depends on how the capacity
    # measurement fell, and this test must not, so its spike is unambiguous. 5x was not: one CI machine measured
    # 1.25 req/s, half of what it then served, and its 5x spike kept standard's TTFT under 0.5 of its target.
    report = run_loadgen_sync(LoadgenConfig(
        url=w5_server.base_url, lanes=W5_LANES, capacity=capacity, load=0.5, duration_s=30, seed=9,
        pattern=SpikyArrivals(factor=20.0, spike_len_s=8.0, period_s=1000.0, start_s=4.0), metrics_interval_s=0.25))
    print(report.table())
    _check_every_request_accounted(report)
    levels = [s.level for s in report.brownout if s.level is not None]
    assert levels and max(levels) >= 1, "brownout never entered during the spike"
    # Leaving takes exit_after_s per level once the backlog is gone: keep watching the gauge for a while.
    levels += _wait_for_brownout_level_zero(w5_server.base_url, 40)
    assert levels[-1] == 0, f"brownout did not leave after the spike (levels {levels[-20:]})"
    # No oscillation: the level climbs, then descends, with no second climb.
    changes = [b - a for a, b in zip(levels, levels[1:]) if b != a]
    first_down = next((i for i, c in enumerate(changes) if c < 0), len(changes))
    assert all(c < 0 for c in changes[first_down:]), f"brownout oscillated: level changes {changes}"


def _wait_for_brownout_level_zero(base_url: str, timeout_s: float) -> list[float]:
    """Poll the brownout gauge until it reads 0 (or the time is up); returns the levels seen."""
    seen: list[float] = []
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        level = brownout_level(httpx.get(f"{base_url}/metrics").text)
        if level is not None:
            seen.append(level)
            if level == 0:
                break
        time.sleep(0.25)
    return seen
