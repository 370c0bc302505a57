"""The queueing model against live load (issue 32's check in CI): `rtx serve` with the sla-lanes scheduler and
W5's CPU lanes takes half its measured capacity from `rtx loadgen`; the model, given the step-time profile the
server's engine learnt meanwhile (the serving path's seconds included) and the very requests the load phase sent
(their send times, lanes and lengths), predicts the median time to first token the client measured.

Within 10% (the issue's bar). Runs here gave 0.93x and 0.90x, then 0.88x, while the learnt profile counted the
engine's waits for work in the step before them; with those out (EngineCore.note_idle) 1.03x and 1.00x, and
0.99x with the line fitted on the steps with a prefill chunk alone (2026-12-05). The in-process profile alone
predicts 0.4-0.7x.

The client's figure runs from the send to the first streamed token, as the model's clock does from the arrival. The
engine's own figure (the `rtx.requests` timelines: submission to first token) is shown beside it."""

from __future__ import annotations

import time

import pytest

from rtxcore.bench.loadgen import LoadgenConfig, Outcome, run_loadgen_sync
from rtxcore.bench.loadgen.stats import percentile
from rtxcore.bench.loadgen.workload import plan_requests
from rtxcore.capacity.profile import from_server
from rtxcore.capacity.simulation import arrivals_of, simulate
from rtxcore.contracts.scheduler import SchedulerConfig
from rtxcore.engine.config import EngineConfig
from rtxcore.metrics.timeline import read_timelines
from rtxcore.server.serve_config import load_serve_config
from tests.helpers.server import start_server
from tests.helpers.w5 import MAX_NUM_BATCHED_TOKENS, MAX_NUM_SEQS, SERVER_ARGS, W5_CONFIG, W5_LANES

# Serial: the live latencies are what is checked, and a test running beside it would change them.
pytestmark = pytest.mark.serial

BLOCK_SIZE = 16


def server_ttfts(stderr: str, since: float) -> list[float]:
    """Time to first token of every request submitted after ``since`` (Unix time) that finished, from the server's
    request timelines."""
    return [t["ttft_s"] for t in read_timelines(stderr.splitlines())
            if t.get("event") == "request_finished" and t["enqueue"] >= since and t.get("ttft_s")]


def test_the_model_predicts_the_median_time_to_first_token_at_half_capacity():
    server = start_server(*SERVER_ARGS)
    try:
        # The capacity phase also gives the engine's profile its first few hundred steps.
        capacity = run_loadgen_sync(LoadgenConfig(url=server.base_url, lanes=W5_LANES, capacity_clients=16,
                                                  capacity_duration_s=30, duration_s=1, load=0.1)).capacity
        assert capacity is not None and capacity > 0
        # Logprobs name each chunk's tokens: the client's first token is then the first one the engine sampled,
        # not the first that carried text (the detokenizer holds back a token that ends inside a character).
        config = LoadgenConfig(url=server.base_url, lanes=W5_LANES, capacity=capacity, duration_s=200, load=0.5,
                               seed=32, request_timeout_s=300, logprobs=True)
        started = time.time()
        report = run_loadgen_sync(config)
        profile, blocks = from_server(server.base_url, BLOCK_SIZE)
    finally:
        assert server.stop() == 0, server.output()
    # A burst of Poisson arrivals can make the sla-lanes admission refuse a request (429 with Retry-After) even at
    # half capacity: once in 176 in a CI dry run. The model's engine runs the same admission; nothing else may fail.
    sent, completed = report.overall.num_sent, report.overall.count(Outcome.COMPLETED)
    refused = report.overall.count(Outcome.REJECTED_429)
    assert completed + refused == sent and refused <= max(1, sent // 50), report.overall.num_by_outcome
    measured = server_ttfts(server.stderr, started)
    assert len(measured) == completed

    served_config = load_serve_config(str(W5_CONFIG))
    served = EngineConfig(scheduler="sla-lanes", num_kv_blocks=blocks, scheduling=SchedulerConfig(
        max_num_seqs=MAX_NUM_SEQS, max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS, lanes=served_config.lanes,
        options=served_config.scheduler_options))
    # Three draws of the steps' times from the profile's spread, pooled: the prediction's own noise out of the way.
    arrivals = arrivals_of(plan_requests(config, report.offered_rate))
    predicted = percentile([t for seed in (1, 2, 3) for lane in simulate(served, profile, arrivals, seed).lanes.values()
                            for t in lane.ttft_s], 50)
    client_p50, engine_p50 = report.overall.ttft_s[50], percentile(measured, 50)
    assert predicted is not None and engine_p50 is not None and client_p50 is not None
    ratio = predicted / client_p50
    figures = (f"predicted p50 TTFT {predicted:.3f}s against {client_p50:.3f}s measured by the client ({ratio:.2f}x; "
               f"the engine measured {engine_p50:.3f}s) at {report.offered_rate:.2f} requests/s, {len(measured)} "
               f"requests, profile {profile.base_s * 1000:.1f} ms + {profile.per_token_s * 1000:.2f} ms/token + "
               f"{profile.per_row_s * 1000:.2f} ms/request, "
               f"spread of decodes {[round(r, 2) for r in profile.decode_spread]}, of the other steps "
               f"{[round(r, 2) for r in profile.spread]}")
    print(figures)  # shown with -rP: how close a passing run came
    assert 0.9 <= ratio <= 1.1, figures
