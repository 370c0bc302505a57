"""``/dashboard`` in headless Chromium (Debian's ``chromium``, tests/helpers/browser.py): the page loads from the
server alone, polls ``/metrics``, and every figure it shows equals the one computed here from the same ``/metrics``;
a screenshot is kept under ``test-artifacts/`` for a person to look at."""

from __future__ import annotations

import math
import re
import threading

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.helpers.browser import ARTIFACTS, browse, find_chromium, histogram_quantile, shown_figures
from tests.helpers.server import start_server

KEY = "sk-dashboard"
LANES = ("realtime", "standard", "bulk")


@pytest.fixture(scope="module")
def chromium():
    return find_chromium()


@pytest.fixture(scope="module")
def server():
    srv = start_server("--no-grpc", "--model", "dummy:tiny", "--scheduler", "sla-lanes", "--api-key", KEY,
                       "--kv-host-bytes", "4MiB", "--max-num-seqs", "4")
    yield srv
    assert srv.stop() == 0, srv.output()


def _traffic(server) -> None:
    """A few requests in every lane at once, some repeating a prompt (prefix hits), then idle."""
    def send(lane: str, i: int) -> None:
        r = httpx.post(f"{server.base_url}/v1/completions", timeout=120,
                       headers={"authorization": f"Bearer {KEY}", "x-rtx-lane": lane},
                       json={"prompt": [3 + i % 2] * 40 + [i], "max_tokens": 8, "ignore_eos": True})
        assert r.status_code == 200, r.text
    threads = [threading.Thread(target=send, args=(lane, i)) for lane in LANES for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def _samples(text: str) -> list:
    return [s for family in text_string_to_metric_families(text) for s in family.samples]


def _total(samples, name: str, **labels) -> float:
    return sum(s.value for s in samples if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()))


def _quantile(q: float, samples, name: str, **labels) -> float | None:
    """histogram_quantile over the lifetime buckets (what the page shows when idle: "since start")."""
    counts: dict[float, float] = {}
    for s in samples:
        if s.name == name + "_bucket" and all(s.labels.get(k) == v for k, v in labels.items()):
            le = math.inf if s.labels["le"] == "+Inf" else float(s.labels["le"])
            counts[le] = counts.get(le, 0.0) + s.value
    return histogram_quantile(q, counts)


def test_the_dashboard_shows_the_servers_metrics(server, chromium, tmp_path):
    # Open, like /metrics, while the API itself wants the key.
    page = httpx.get(server.base_url + "/dashboard")
    assert page.status_code == 200 and "text/html" in page.headers["content-type"]
    assert "script-src 'self'" in page.headers["content-security-policy"]
    assert not re.search(r"(src|href)=\"https?:", page.text), "the page must not load anything from elsewhere"
    assert httpx.get(server.base_url + "/dashboard/dashboard.js").status_code == 200
    assert httpx.get(server.base_url + "/v1/models").status_code == 401

    _traffic(server)
    dom = browse(chromium, server.base_url + "/dashboard?interval_ms=1000", tmp_path, "--dump-dom")
    samples = _samples(httpx.get(server.base_url + "/metrics").text)
    shown = shown_figures(dom)
    assert shown.get("status") == "live", dom[:2000]

    expected: dict[str, float | None] = {
        "running": _total(samples, "rtx_num_requests_running"),
        "waiting": _total(samples, "rtx_num_requests_waiting"),
        "steps": _total(samples, "rtx_engine_steps_total"),
        "generated": _total(samples, "rtx_generation_tokens_total"),
        "oom": _total(samples, "rtx_oom_total"),
        "kv-usage": _total(samples, "rtx_kv_cache_usage_ratio"),
        "hit-rate": _total(samples, "rtx_prefix_cache_hits_total") / _total(samples, "rtx_prefix_cache_queries_total"),
        "brownout-level": _total(samples, "rtx_brownout_level"),
        "tier-capacity:host": _total(samples, "rtx_kv_tier_capacity_bytes", tier="host"),
        "tier-used:device": _total(samples, "rtx_kv_tier_used_bytes", tier="device"),
    }
    for lane in LANES:
        expected[f"lane-queued:{lane}"] = _total(samples, "rtx_lane_requests_queued", lane=lane)
        expected[f"lane-ttft-target:{lane}"] = _total(samples, "rtx_lane_target_seconds", lane=lane, latency="ttft")
        expected[f"lane-itl-target:{lane}"] = _total(samples, "rtx_lane_target_seconds", lane=lane, latency="itl")
        expected[f"lane-ttft-predicted:{lane}"] = _total(samples, "rtx_lane_predicted_ttft_seconds", lane=lane)
        for q in (50, 95):
            expected[f"lane-ttft-p{q}:{lane}"] = _quantile(q / 100, samples, "rtx_lane_time_to_first_token_seconds",
                                                           lane=lane)
            expected[f"lane-itl-p{q}:{lane}"] = _quantile(q / 100, samples, "rtx_lane_inter_token_latency_seconds",
                                                          lane=lane)
    # The traffic really happened and reached every lane: the figures compared are not all zeros.
    assert expected["generated"] == 8 * len(LANES) * 4 and expected["steps"] > 0
    assert all(expected[f"lane-ttft-p95:{lane}"] for lane in LANES)
    assert expected["lane-ttft-target:realtime"] < expected["lane-ttft-target:bulk"]
    # The scheduler's model had seen enough steps to predict; bulk's longer prompts wait longer than realtime's.
    assert 0 < expected["lane-ttft-predicted:realtime"] <= expected["lane-ttft-predicted:bulk"]
    for key, value in expected.items():
        assert key in shown, f"{key} is not on the page"
        if value is None:
            assert shown[key] == "", (key, shown[key])
        else:
            assert float(shown[key]) == pytest.approx(value, rel=1e-9, abs=1e-12), key
    # Idle since the traffic: lifetime figures, and the page says so.
    assert shown["window"].startswith("since start"), shown["window"]
    assert float(shown["batch-mean"]) == pytest.approx(
        _total(samples, "rtx_batch_size_sum") / _total(samples, "rtx_batch_size_count"), rel=1e-9)
    # Not started with --fleet-peers: the replicas panel says how to have it, and shows no figures.
    assert shown["fleet-note"].startswith("not configured") and shown["fleet-replicas"] == ""
    # No GPU here: the panel says so instead of showing zeros.
    assert "not measured" in shown["gpu-note"]
    # The one refusal is the key-less /v1/models above: the page itself asks for nothing outside its open paths.
    assert _total(samples, "rtx_requests_rejected_total") == 1 and shown["rejected"] == "1"

    ARTIFACTS.mkdir(exist_ok=True)
    shot = ARTIFACTS / "dashboard.png"
    browse(chromium, server.base_url + "/dashboard", tmp_path, f"--screenshot={shot}", "--window-size=1400,1000",
            "--hide-scrollbars")
    assert shot.stat().st_size > 10_000
