"""The dashboard's replicas and autoscaling panel: one server reads its peers' ``/metrics`` (rtxcore.server.fleet)
and applies the Helm chart's HPA rule to them. Two live servers on 127.0.0.1 stand for two pods."""

from __future__ import annotations

import asyncio
import math
import threading
import time

import httpx
import pytest
from prometheus_client import CollectorRegistry, Gauge, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from rtxcore.errors import ConfigError
from rtxcore.server.fleet import FleetSettings, FleetWatcher, hpa_proposal, parse_peer, value_proposal
from rtxcore.server.fleet import histogram_quantile as server_quantile
from tests.helpers.browser import ARTIFACTS, browse, find_chromium, histogram_quantile, shown_figures
from tests.helpers.cli import assert_one_line_error, rtx
from tests.helpers.server import start_server

MODEL = ("--no-grpc", "--model", "dummy:tiny")


def test_the_quantile_is_prometheus_histogram_quantile():
    # Linear within the bucket holding the rank; from 0 in the first bucket; the +Inf bucket gives the last bound.
    assert server_quantile(0.95, {0.1: 0, 0.5: 10, math.inf: 10}) == pytest.approx(0.1 + 0.4 * 0.95)
    assert server_quantile(0.5, {0.1: 4, 0.5: 8, math.inf: 8}) == pytest.approx(0.1)
    assert server_quantile(0.25, {0.1: 4, 0.5: 8, math.inf: 8}) == pytest.approx(0.05)
    assert server_quantile(0.95, {0.1: 0, 0.5: 5, math.inf: 10}) == 0.5
    assert server_quantile(0.95, {0.1: 0, math.inf: 0}) is None and server_quantile(0.5, {}) is None


def test_the_hpa_rule_has_its_tolerance_rounds_up_and_counts_missing_pods_as_kubernetes_does():
    assert hpa_proposal(2, [4.3, 4.3], 0, 4.0) == 2      # within 10% of the target: no change
    assert hpa_proposal(2, [4.5, 4.5], 0, 4.0) == 3      # 2 x 1.125 = 2.25, rounded up
    assert hpa_proposal(4, [1.0] * 4, 0, 4.0) == 1
    assert hpa_proposal(3, [0.0] * 3, 0, 4.0) == 0       # the bounds clamp it, not the rule
    assert hpa_proposal(3, [], 3, 4.0) is None           # nobody has it: unavailable
    # Scaling up, a pod without the metric counts as 0: one of four at twice the target, three with none,
    # averages half the target, a reversal: stay.
    assert hpa_proposal(4, [8.0], 3, 4.0) == 4
    # Two of four far above: 2 x 16 / 4 pods = 8 per pod, twice the target: 8 replicas.
    assert hpa_proposal(4, [16.0, 16.0], 2, 4.0) == 8
    # Scaling down, a pod without it counts as at the target: (0 + 0 + 4 + 4) / 4 = half: 2.
    assert hpa_proposal(4, [0.0, 0.0], 2, 4.0) == 2
    assert value_proposal(3, 2.0, 1.0) == 6 and value_proposal(3, 1.05, 1.0) == 3 and value_proposal(3, None, 1) is None


def test_a_restarted_peer_starts_its_window_again_and_old_scrapes_leave_it():
    """Counters that went down (a restarted container at the same address) begin a new window, as rate() treats a
    reset; scrapes older than the window leave it."""
    registry = CollectorRegistry()
    histogram = Histogram("rtx_time_to_first_token_seconds", "", registry=registry)

    def metrics(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, content=generate_latest(registry))

    watcher = FleetWatcher(FleetSettings(("127.0.0.1:1001",), window_s=1000.0))

    async def scrape() -> float | None:
        async with httpx.AsyncClient(transport=httpx.MockTransport(metrics)) as client:
            await watcher.scrape_once(client, 8000)
        return watcher.view()["pods"][0]["ttft_p95_s"]

    assert asyncio.run(scrape()) is None  # one scrape: no increase yet
    for _ in range(20):
        histogram.observe(4.0)
    assert 2.5 < asyncio.run(scrape()) <= 5.0
    # The restart: a fresh histogram with fewer, faster requests. Without the reset the increase would be negative.
    registry.unregister(histogram)
    histogram = Histogram("rtx_time_to_first_token_seconds", "", registry=registry)
    for _ in range(5):
        histogram.observe(0.02)
    assert asyncio.run(scrape()) is None  # a new window of one scrape
    for _ in range(5):
        histogram.observe(0.02)
    assert asyncio.run(scrape()) <= 0.025


def test_peers_parse_and_bad_ones_are_named():
    assert parse_peer("rtx-peers", 8000) == ("rtx-peers", 8000)
    assert parse_peer("10.0.0.3:9000", 8000) == ("10.0.0.3", 9000)
    assert parse_peer("[::1]:9000", 8000) == ("::1", 9000) and parse_peer("[::1]", 80) == ("::1", 80)
    for bad in ("host:http", "host:0", "[::1", ":80", "host:70000"):
        with pytest.raises(ConfigError, match="--fleet-peers"):
            parse_peer(bad, 8000)


@pytest.mark.parametrize("mode", ["hpa", "keda"])
def test_hpa_mode_averages_the_pods_p95s_and_keda_mode_takes_one_p95_of_all(mode):
    """Two pods' /metrics as prometheus_client writes them, served by an in-process transport: one pod answers fast,
    the other slowly; the latency signal is the mean of their p95s (HPA, per-pod metric) or the p95 of their summed
    buckets (the chart's KEDA query)."""
    pods = {}
    for port, seconds in ((1001, 0.05), (1002, 3.0)):
        registry = CollectorRegistry()
        Gauge("rtx_num_requests_waiting", "", registry=registry).set(port - 1000)
        pods[port] = (registry, Histogram("rtx_time_to_first_token_seconds", "", registry=registry), seconds)

    def metrics(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, content=generate_latest(pods[request.url.port][0]))

    watcher = FleetWatcher(FleetSettings(("127.0.0.1:1001", "127.0.0.1:1002"), target_queue_depth=1.0,
                                         target_ttft_p95_s=1.0, max_replicas=10, mode=mode))

    async def scrape_twice() -> dict:
        async with httpx.AsyncClient(transport=httpx.MockTransport(metrics)) as client:
            await watcher.scrape_once(client, 8000)
            for _, histogram, seconds in pods.values():
                for _ in range(10):
                    histogram.observe(seconds)
            await watcher.scrape_once(client, 8000)
        return watcher.view()

    view = asyncio.run(scrape_twice())
    queue, ttft = view["signals"]
    assert queue["average"] == 1.5 and queue["proposal"] == 3
    p95s = [p["ttft_p95_s"] for p in view["pods"]]
    assert p95s[0] < 0.1 and 2.5 < p95s[1] <= 5.0
    bounds = {0.05: 10, 2.5: 10, 5.0: 20, math.inf: 20}  # the default buckets the 20 observations fall in
    expected = sum(p95s) / 2 if mode == "hpa" else histogram_quantile(0.95, bounds)
    assert ttft["average"] == pytest.approx(expected) and view["mode"] == mode
    assert view["desired_replicas"] == max(3, math.ceil(2 * expected))


@pytest.mark.parametrize(("args", "fragment"), [
    (("--autoscale-queue-depth", "4"), "--autoscale-queue-depth needs --fleet-peers"),
    (("--fleet-peers", "a", "--autoscale-replicas", "3:2"), "1 <= MIN <= MAX"),
    (("--fleet-peers", "a", "--autoscale-replicas", "two"), "MIN:MAX"),
    (("--fleet-peers", "a:b"), "'a:b'"),
    (("--fleet-peers", "a", "--autoscale-ttft-p95", "0"), "--autoscale-ttft-p95 must be a positive number"),
    (("--autoscale-mode", "keda"), "--autoscale-mode needs --fleet-peers"),
])
def test_bad_fleet_flags_exit_2_with_one_line(args, fragment):
    assert_one_line_error(rtx("serve", *MODEL, *args, timeout=60), fragment)


def _samples(base_url: str) -> list:
    text = httpx.get(base_url + "/metrics").text
    return [s for family in text_string_to_metric_families(text) for s in family.samples]


def _lifetime_p95(base_url: str) -> float | None:
    counts: dict[float, float] = {}
    for s in _samples(base_url):
        if s.name == "rtx_time_to_first_token_seconds_bucket":
            le = float(s.labels["le"])
            counts[le] = counts.get(le, 0.0) + s.value
    return histogram_quantile(0.95, counts)


def _view_after(base_url: str, since: float, condition=lambda view: True) -> dict:
    """The first fleet view read after ``since`` (wall clock) that meets ``condition``."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        view = httpx.get(base_url + "/dashboard/fleet.json").json()
        if view["updated_at"] is not None and view["updated_at"] > since and condition(view):
            return view
        time.sleep(0.1)
    raise AssertionError(f"no fleet view after {since} met the condition: {view}")


def _send(base_url: str, n: int) -> None:
    def one(i: int) -> None:
        r = httpx.post(base_url + "/v1/completions", timeout=120,
                       json={"prompt": [7, 8, i], "max_tokens": 6, "ignore_eos": True})
        assert r.status_code == 200, r.text
    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def test_two_servers_see_each_other_and_apply_the_hpa_rule(tmp_path):
    other = start_server(*MODEL)
    other_port = other.base_url.rsplit(":", 1)[1]
    # This server with no port (its own, as the chart gives its headless Service's name), the other with its port.
    watcher = start_server(*MODEL, "--fleet-peers", f"127.0.0.1,127.0.0.1:{other_port}", "--fleet-interval", "0.3",
                           "--autoscale-queue-depth", "4", "--autoscale-ttft-p95", "0.000001",
                           "--autoscale-replicas", "2:5")
    try:
        own_port = watcher.base_url.rsplit(":", 1)[1]
        # No TTFT observed yet: the p95 signal has no value and proposes nothing; idle queues ask for 0, so the
        # lower bound holds.
        view = _view_after(watcher.base_url, 0, lambda v: v["replicas"] == 2)
        assert view["desired_replicas"] == 2
        assert [s["average"] for s in view["signals"]] == [0.0, None]

        _send(watcher.base_url, 3)
        _send(other.base_url, 5)
        idle = time.time()
        view = _view_after(watcher.base_url, idle)
        pods = {p["address"]: p for p in view["pods"]}
        assert set(pods) == {f"127.0.0.1:{own_port}", f"127.0.0.1:{other_port}"} and view["unreachable"] == 0
        # Within the two-minute window since each server started: each pod's p95 is its lifetime histogram's.
        p95s = []
        for port, srv in ((own_port, watcher), (other_port, other)):
            pod = pods[f"127.0.0.1:{port}"]
            assert pod["up"] and pod["queue_depth"] == 0
            p95s.append(_lifetime_p95(srv.base_url))
            assert pod["ttft_p95_s"] == pytest.approx(p95s[-1], rel=1e-9)
        queue, ttft = view["signals"]
        assert ttft["average"] == pytest.approx(sum(p95s) / 2, rel=1e-9)
        # Far above its target: the rule asks for many times the two replicas, and the upper bound caps it.
        assert ttft["proposal"] == math.ceil(2 * ttft["average"] / 0.000001) and view["desired_replicas"] == 5
        assert queue["average"] == 0 and queue["proposal"] == 0

        chromium = find_chromium()
        shown = shown_figures(browse(chromium, watcher.base_url + "/dashboard?interval_ms=500", tmp_path,
                                     "--dump-dom"))
        assert float(shown["fleet-replicas"]) == 2 and float(shown["fleet-desired"]) == 5
        assert float(shown["fleet-average:TTFT p95"]) == pytest.approx(ttft["average"], rel=1e-9)
        assert float(shown["fleet-target:queue depth"]) == 4
        for port, p95 in zip((own_port, other_port), p95s):
            assert float(shown[f"pod-ttft-p95:127.0.0.1:{port}"]) == pytest.approx(p95, rel=1e-9)
        ARTIFACTS.mkdir(exist_ok=True)
        shot = ARTIFACTS / "dashboard-fleet.png"
        browse(chromium, watcher.base_url + "/dashboard?interval_ms=500", tmp_path, f"--screenshot={shot}",
               "--window-size=1400,1300", "--hide-scrollbars")
        assert shot.stat().st_size > 10_000

        # A pod that stops answering is counted apart and left out of the averages.
        assert other.stop() == 0, other.output()
        stopped = time.time()
        view = _view_after(watcher.base_url, stopped, lambda v: v["unreachable"] == 1)
        assert view["replicas"] == 1
        down = next(p for p in view["pods"] if not p["up"])
        assert down["address"] == f"127.0.0.1:{other_port}" and down["error"]
        assert view["signals"][1]["average"] == pytest.approx(p95s[0], rel=1e-9)
    finally:
        other.stop()
        assert watcher.stop() == 0, watcher.output()
