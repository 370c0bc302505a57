"""The load generator: its arrival schedules, sampling and statistics, its report, its command line, and runs
against a real ``rtx serve`` on ``dummy:tiny`` (no tokenizer: requests ask for logprobs so chunks carry tokens)."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from rtxcore.bench.loadgen import (
    DEFAULT_LANES,
    BrownoutSample,
    LaneStats,
    LaneTarget,
    LaneTargets,
    LoadgenConfig,
    LoadgenReport,
    Outcome,
    PoissonArrivals,
    RequestResult,
    SpikyArrivals,
    Tenant,
    arrival_times,
    brownout_level,
    count_level_changes,
    percentile,
    plan_requests,
    random_prompt,
    run_loadgen_sync,
    sample_request,
)
from rtxcore.cli.main import main
from rtxcore.errors import ConfigError
from tests.helpers.server import start_server

RTX = str(Path(sys.executable).parent / "rtx")


# -- arrivals ------------------------------------------------------------------------------------------------------


def test_poisson_arrivals_have_the_asked_rate_and_exponential_gaps():
    times = arrival_times(PoissonArrivals(), 20.0, 500.0, random.Random(0))
    assert len(times) / 500.0 == pytest.approx(20.0, rel=0.03)
    assert times == sorted(times) and 0 <= times[0] and times[-1] < 500.0
    gaps = np.diff(times)
    # An exponential distribution's standard deviation equals its mean.
    assert gaps.std() / gaps.mean() == pytest.approx(1.0, abs=0.05)
    assert arrival_times(PoissonArrivals(), 20.0, 500.0, random.Random(0)) == times
    assert arrival_times(PoissonArrivals(), 20.0, 500.0, random.Random(1)) != times


def test_spiky_arrivals_multiply_the_rate_inside_spikes_only():
    pattern = SpikyArrivals(factor=3.0, spike_len_s=2.0, period_s=10.0, start_s=4.0)
    assert [pattern.in_spike(t) for t in (0.0, 3.99, 4.0, 5.99, 6.0, 13.99, 14.0, 15.5, 16.0)] == \
        [False, False, True, True, False, False, True, True, False]
    duration = 1000.0
    times = arrival_times(pattern, 10.0, duration, random.Random(0))
    inside = sum(1 for t in times if pattern.in_spike(t))
    spike_time = 2.0 * duration / 10.0  # 100 spikes of 2 s
    assert inside / spike_time == pytest.approx(30.0, rel=0.05)
    assert (len(times) - inside) / (duration - spike_time) == pytest.approx(10.0, rel=0.05)


def test_plan_is_reproducible_from_the_seed():
    config = LoadgenConfig(rate=5.0, duration_s=60.0, seed=7)
    plan = plan_requests(config, 5.0)
    assert plan == plan_requests(config, 5.0)
    assert plan != plan_requests(LoadgenConfig(rate=5.0, duration_s=60.0, seed=8), 5.0)


def test_a_plan_past_its_bound_is_refused_not_drawn():
    # The rate a measured capacity gives is known only then: the plan refuses it rather than fill memory.
    with pytest.raises(ConfigError, match="100000 requests/s for 30 s is about 3,000,000 requests; at most 1,000,000"):
        plan_requests(LoadgenConfig(load=2.0, duration_s=30.0), 1e5)


# -- what is sent --------------------------------------------------------------------------------------------------


def test_lane_and_tenant_mix_follow_their_weights_and_lengths_their_ranges():
    rng = random.Random(0)
    tenants = (Tenant("a", "key-a", 3.0), Tenant("b", "key-b", 1.0))
    planned = [sample_request(rng, DEFAULT_LANES, tenants) for _ in range(20000)]
    for lane in DEFAULT_LANES:
        mine = [p for p in planned if p.lane == lane.name]
        assert len(mine) / len(planned) == pytest.approx(lane.weight, abs=0.01)
        prompts = {p.num_prompt_tokens for p in mine}
        outputs = {p.max_tokens for p in mine}
        assert (min(prompts), max(prompts)) == (lane.prompt_tokens.low, lane.prompt_tokens.high)
        assert (min(outputs), max(outputs)) == (lane.output_tokens.low, lane.output_tokens.high)
    assert sum(p.tenant.name == "a" for p in planned) / len(planned) == pytest.approx(0.75, abs=0.01)
    assert sample_request(rng, DEFAULT_LANES, ()).tenant is None


def test_random_prompts_have_the_exact_length_and_differ():
    rng = random.Random(0)
    first, second = random_prompt(64, (100, 500), rng), random_prompt(64, (100, 500), rng)
    assert len(first) == 64 and all(100 <= t < 500 for t in first + second)
    assert first[:16] != second[:16]  # different first KV block: no prefix-cache hit


# -- statistics and the report -------------------------------------------------------------------------------------


def test_percentile_matches_numpy_linear():
    values = [random.Random(3).expovariate(1.0) for _ in range(101)]
    for q in (0, 50, 95, 99, 100):
        assert percentile(values, q) == pytest.approx(float(np.percentile(values, q)))
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5
    assert percentile([7.0], 99) == 7.0
    assert percentile([], 50) is None


def result(lane: str, outcome: Outcome, ttft: float | None = None, itl: list[float] | None = None,
           retry_after: float | None = None) -> RequestResult:
    status = {Outcome.COMPLETED: 200, Outcome.REJECTED_429: 429, Outcome.ERROR_5XX: 500,
              Outcome.ERROR_OTHER: 400, Outcome.LOST: None}[outcome]
    return RequestResult(lane, None, 0.0, 16, outcome, status, ttft, itl or [], 16 if ttft else 0,
                         "length" if ttft else None, ttft is not None, retry_after)


def make_report() -> LoadgenReport:
    targets = {"realtime": LaneTarget(0.5, 0.2), "bulk": LaneTarget(10.0, 1.0)}
    results = [
        result("realtime", Outcome.COMPLETED, 0.1, [0.05, 0.06]),           # good
        result("realtime", Outcome.COMPLETED, 0.7, [0.05]),                 # TTFT over target
        result("realtime", Outcome.COMPLETED, 0.2, [0.05] * 19 + [0.5] * 2),  # p95 ITL over target
        result("realtime", Outcome.REJECTED_429, retry_after=2.0),
        result("bulk", Outcome.COMPLETED, 3.0, []),                         # one chunk: nothing to judge ITL on
        result("bulk", Outcome.REJECTED_429),                               # no Retry-After
        result("bulk", Outcome.ERROR_5XX),
        result("bulk", Outcome.ERROR_OTHER),
        result("bulk", Outcome.LOST),
    ]
    lanes = [LaneStats.from_results(name, [r for r in results if r.lane == name], targets, 10.0)
             for name in ("realtime", "bulk")]
    brownout = [BrownoutSample(0.0, None), BrownoutSample(0.5, 0.0), BrownoutSample(1.0, 1.0),
                BrownoutSample(1.5, None), BrownoutSample(2.0, 1.0), BrownoutSample(2.5, 0.0)]
    return LoadgenReport("http://127.0.0.1:1", SpikyArrivals(), 3.0, 1.5, 10.0, 0, 2.0, None,
                         LaneTargets(targets, "server"), lanes, LaneStats.from_results("all", results, targets, 10.0),
                         brownout, 0.004, results)


def test_lane_stats_count_outcomes_and_goodput():
    report = make_report()
    realtime, bulk = report.lanes
    assert (realtime.num_sent, realtime.count(Outcome.COMPLETED), realtime.count(Outcome.REJECTED_429)) == (4, 3, 1)
    assert realtime.num_good == 1 and realtime.goodput_fraction == 0.25 and realtime.goodput_rate == 0.1
    assert (realtime.num_retry_after, realtime.max_retry_after_s) == (1, 2.0)
    assert realtime.ttft_s[50] == 0.2
    assert [bulk.count(o) for o in Outcome] == [1, 1, 1, 1, 1] and bulk.num_good == 1
    assert bulk.num_retry_after == 0 and bulk.itl_s[50] is None
    assert report.overall.num_sent == 9 and report.overall.num_good == 2


def test_report_json_shape_and_table():
    report = make_report()
    data = json.loads(json.dumps(report.to_json()))  # plain JSON types only
    assert data["pattern"] == {"name": "spiky", "factor": 3.0, "spike_len_s": 10.0, "period_s": 60.0,
                               "start_s": 20.0}
    assert (data["offered_rate_rps"], data["load"], data["capacity_rps"]) == (3.0, 1.5, 2.0)
    assert set(data["lanes"]) == {"realtime", "bulk"}
    lane = data["lanes"]["realtime"]
    assert set(lane) == {"sent", "completed", "rejected_429", "errors_5xx", "errors_other", "lost", "ttft_s",
                         "itl_s", "good", "goodput_fraction", "goodput_rps", "completion_tokens", "retry_after"}
    assert set(lane["ttft_s"]) == set(lane["itl_s"]) == {"p50", "p95", "p99"}
    assert data["overall"]["lost"] == 1 and data["overall"]["errors_5xx"] == 1
    assert data["brownout"]["num_changes"] == 2 and data["brownout"]["levels_seen"] == [0.0, 1.0]
    assert data["brownout"]["samples"][0] == [0.0, None]
    assert len(data["requests"]) == 9 and data["targets"]["source"] == "server"
    table = report.table()
    rows = table.splitlines()[1:5]
    assert [r.split()[0] for r in rows] == ["lane", "realtime", "bulk", "all"]
    assert len({len(r) for r in rows}) == 1  # aligned columns
    assert rows[3].split()[1:7] == ["9", "4", "2", "1", "1", "1"]
    assert "max 1, 2 changes" in table


def test_brownout_level_from_prometheus_text():
    text = ("# HELP rtx_brownout_level Current brownout level.\n# TYPE rtx_brownout_level gauge\n"
            'rtx_brownout_level{model="smollm2-135m"} 2.0\nrtx_brownout_level_x 9\n')
    assert brownout_level(text) == 2.0
    assert brownout_level("rtx_brownout_level 1\n") == 1.0
    assert brownout_level("# TYPE rtx_engine_steps_total counter\nrtx_engine_steps_total 3\n") is None
    assert count_level_changes([BrownoutSample(0, 0), BrownoutSample(1, 0), BrownoutSample(2, None)]) == 0


# -- command line --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("args, fragment", [
    (["--rate", "2", "--load", "1.5"], "either a rate or a load"),
    (["--rate", "0"], "rate must be a positive number"),
    (["--duration", "soon"], "'soon' is not a number"),
    (["--pattern", "bursty"], "invalid choice"),
    (["--spike-factor", "4"], "need --pattern spiky"),
    (["--pattern", "spiky", "--spike-len", "90"], "spike length must be in (0, period]"),
    (["--tenant", "acme"], "expected NAME=KEY[:WEIGHT]"),
    (["--lane-mix", "realtime=lots"], "--lane-mix realtime: expected a number"),
    (["--lane-mix", "vip=1"], "lane vip has no default lengths"),
    (["--prompt-tokens", "realtime=64:16"], "--prompt-tokens realtime: a length range needs 1 <= low <= high"),
    (["--output-tokens", "batch=1:2"], "not in --lane-mix"),
    (["--target", "realtime=0.5"], "expected TTFT_S:ITL_S"),
    (["--url", "127.0.0.1:8000"], "must start with http://"),
    # Bounded counts, refused before any request: a client task each, a prompt of that many ids, a plan of every
    # arrival in memory.
    (["--capacity-clients", "99999999"], "argument --capacity-clients: '99999999' is more than 4,096"),
    (["--prompt-tokens", "realtime=16:99999999"], "--prompt-tokens realtime: a length range needs 1 <= low <= high, "
                                                  "high at most 1,048,576, got 16:99999999"),
    (["--output-tokens", "bulk=1:2000000"], "--output-tokens bulk: a length range"),
    (["--rate", "1e9"], "--rate 1e+09 requests/s for --duration 30 s is about 30,000,000,000 requests; at most "
                        "1,000,000"),
    (["--load", "2", "--capacity", "1e8"], "--load 2 x --capacity 1e+08 requests/s"),
    (["--url", ""], "argument --url: must start with http://"),
    (["--model", ""], "argument --model: must not be empty"),
    (["--url", "http://127.0.0.1:9", "--rate", "1"], "cannot reach the server"),
])
def test_bad_options_one_line_exit_2(args, fragment, capsys):
    try:
        code = main(["loadgen", *args])
    except SystemExit as exc:  # argparse's own errors
        code = exc.code
    err = capsys.readouterr().err
    assert code == 2, err
    assert len(err.splitlines()) == 1 and fragment in err, err


# -- against a real server -----------------------------------------------------------------------------------------


def test_rtx_loadgen_against_a_server_completes_every_request(tmp_path):
    """The typical call, scaled down: capacity measured (4 s: a busy 2-core machine may finish nothing in a shorter
    steady part, so answers are shorter than the default mix's too), then 1.5x of it; every request ends 200 with
    [DONE]."""
    out = tmp_path / "out.json"
    with start_server("--model", "dummy:tiny", "--no-grpc") as server:
        for duration in ("3", "15"):
            proc = subprocess.run(
                [RTX, "loadgen", "--url", server.base_url, "--duration", duration, "--load", "1.5",
                 "--capacity-clients", "4", "--capacity-duration", "4", "--output-tokens", "standard=8:24",
                 "--output-tokens", "bulk=8:32", "--logprobs", "--timeout", "30", "--json",
                 str(out)], capture_output=True, text=True, timeout=120)
            assert proc.returncode == 0, proc.stderr + proc.stdout
            data = json.loads(out.read_text())
            # Poisson arrivals over 3 s may be none when a busy machine measured a low capacity (1.5 x 0.2 rps x 3 s
            # arrivals on average): then the phase runs again, longer.
            if data["overall"]["sent"] > 0:
                break
    assert "realtime" in proc.stdout and "capacity" in proc.stdout
    assert data["capacity_measurement"]["num_completed"] > 0
    assert data["offered_rate_rps"] == pytest.approx(1.5 * data["capacity_rps"])
    overall = data["overall"]
    assert overall["sent"] > 0 and overall["completed"] == overall["sent"]
    assert overall["lost"] == overall["errors_5xx"] == overall["errors_other"] == overall["rejected_429"] == 0
    for req in data["requests"]:
        assert (req["status"], req["finish_reason"]) == (200, "length")
        assert req["completion_tokens"] == req["max_tokens"]  # ignore_eos: every asked token came
        assert req["ttft_s"] > 0
    assert {r["lane"] for r in data["requests"]} <= {"realtime", "standard", "bulk"}
    assert len(data["brownout"]["samples"]) >= 3 / 0.5 - 1


def test_overload_is_counted_as_429_with_retry_after_and_nothing_lost():
    with start_server("--model", "dummy:tiny", "--no-grpc", "--max-active-requests", "1") as server:
        report = run_loadgen_sync(LoadgenConfig(url=server.base_url, rate=40.0, duration_s=2.0, logprobs=True,
                                                request_timeout_s=30.0, metrics_interval_s=0.25))
    overall = report.overall
    assert overall.count(Outcome.REJECTED_429) > 0 and overall.count(Outcome.COMPLETED) > 0
    assert overall.count(Outcome.COMPLETED) + overall.count(Outcome.REJECTED_429) == overall.num_sent
    assert overall.count(Outcome.LOST) == overall.count(Outcome.ERROR_5XX) == 0
    rejected = [r for r in report.results if r.outcome is Outcome.REJECTED_429]
    assert all(r.status == 429 and r.retry_after_s is not None and r.retry_after_s > 0 for r in rejected)
    assert overall.num_retry_after == len(rejected)
    assert report.capacity is None and report.load is None and report.offered_rate == 40.0
