"""The queueing model (rtxcore/capacity): the simulation against queueing theory where a closed form holds, and
``rtx plan`` end to end on a given step-time profile."""

from __future__ import annotations

import json
import statistics
import threading
import time

import httpx
import pytest

from rtxcore.bench.loadgen import LaneProfile, LengthRange
from rtxcore.capacity.planner import Planner
from rtxcore.capacity.profile import StepTimeProfile, fit
from rtxcore.capacity.serving_path import PATH_MIN_SAMPLES
from rtxcore.capacity.simulation import poisson_arrivals, simulate
from rtxcore.capacity.step_time import RECORDER_MIN_SAMPLES, SPREAD_QUANTILES
from rtxcore.contracts.scheduler import SchedulerConfig
from rtxcore.engine.config import EngineConfig
from rtxcore.metrics.engine_metrics import PROFILE_EXPORT_INTERVAL_S
from tests.helpers.cli import assert_one_line_error, rtx, run_in_process
from tests.helpers.server import start_server

PROFILE = StepTimeProfile(0.010, 0.0001)
PROMPT, OUTPUT = 100, 2


@pytest.mark.parametrize("rho", [0.5, 0.8])
def test_one_request_at_a_time_is_an_m_d_1_queue(rho):
    """One sequence at a time, fixed lengths, Poisson arrivals: every request takes the same service time S (its
    prefill step, then OUTPUT - 1 decode steps). Each TTFT is then exactly the wait Lindley's recursion gives for
    those arrival times plus the prefill step, and their mean Pollaczek-Khinchine's rho S / (2 (1 - rho)) plus it,
    within sampling error."""
    service = PROFILE.seconds(PROMPT) + (OUTPUT - 1) * PROFILE.seconds(1)
    rate = rho / service
    served = EngineConfig(scheduler="fcfs", num_kv_blocks=64,
                          scheduling=SchedulerConfig(max_num_seqs=1, max_num_batched_tokens=256))
    mix = [LaneProfile("standard", 1.0, LengthRange(PROMPT, PROMPT), LengthRange(OUTPUT, OUTPUT))]
    arrivals = poisson_arrivals(rate, (2500 if rho <= 0.5 else 800) / rate, mix, seed=1)
    result = simulate(served, PROFILE, arrivals)
    lane = result.lanes["standard"]
    assert lane.finished == len(arrivals) and lane.refused == 0
    waits, wait = [], 0.0
    for i, a in enumerate(arrivals):
        if i:
            wait = max(0.0, wait + service - (a.time_s - arrivals[i - 1].time_s))
        waits.append(wait)
    assert lane.ttft_s == pytest.approx([w + PROFILE.seconds(PROMPT) for w in waits], abs=1e-9)
    if rho <= 0.5:  # at 0.8 the mean of 2500 waits is too noisy for a 6% check against the formula
        expected = rho * service / (2 * (1 - rho)) + PROFILE.seconds(PROMPT)
        assert statistics.mean(lane.ttft_s) == pytest.approx(expected, rel=0.06)
    assert result.utilization == pytest.approx(rho, rel=0.05)
    # Every decode gap is one decode step.
    assert set(round(x, 9) for x in lane.itl_s) == {round(PROFILE.seconds(1), 9)}


def test_fit_recovers_a_line():
    samples = [(n, 0.02 + 0.0005 * n) for n in (1, 2, 4, 8, 64, 128)]
    base, per_token = fit(samples)
    assert base == pytest.approx(0.02) and per_token == pytest.approx(0.0005)


def test_capacity_is_where_a_lane_starts_missing_its_target():
    served = EngineConfig(scheduler="sla-lanes", num_kv_blocks=256,
                          scheduling=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=128))
    mix = [LaneProfile("standard", 1.0, LengthRange(32, 64), LengthRange(8, 16))]
    planner = Planner(served, StepTimeProfile(0.02, 0.001), mix, requests=300, seed=3)
    capacity = planner.capacity("standard")
    assert planner.misses("standard", capacity) and not planner.misses("standard", 0.5 * capacity)
    light, heavy = planner.predict(0.25 * capacity), planner.predict(capacity)
    assert light.lanes["standard"].ttft_s["p95"] < heavy.lanes["standard"].ttft_s["p95"]
    assert light.utilization < heavy.utilization


def test_window_ranges_spread_over_short_windows_and_close_in_over_long_ones():
    """`rtx plan --window`: each figure's least and most over other Poisson sequences of one window's length. The
    tail of short windows rests on a few requests and spreads; ten times longer windows hold nearly the same."""
    served = EngineConfig(scheduler="sla-lanes", num_kv_blocks=256,
                          scheduling=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=128))
    mix = [LaneProfile("standard", 1.0, LengthRange(32, 64), LengthRange(8, 16))]
    planner = Planner(served, StepTimeProfile(0.02, 0.001), mix, requests=300, seed=3)
    rate = 0.7 * planner.saturation_rate()
    short, long = planner.windows(rate, 20 / rate, 4), planner.windows(rate, 200 / rate, 4)
    assert short.count == long.count == 4 and short.window_s == pytest.approx(20 / rate)

    def width(w, key, q):
        low, high = w.lanes["standard"][key][q]
        assert 0 < low <= high
        return high - low

    # Seeded, so not flaky; with 4 windows a change to the simulation could flip a close pair, which these are not
    # (the short windows' p95 spreads several times wider here).
    assert width(short, "ttft_s", "p95") > width(long, "ttft_s", "p95") > 0
    assert width(short, "ttft_s", "p50") > width(long, "ttft_s", "p50")
    assert json.loads(json.dumps(short.to_json()))["lanes"]["standard"]["ttft_s"]["p95"] == \
        list(short.lanes["standard"]["ttft_s"]["p95"])


def test_rtx_plan_reports_capacity_predictions_replicas_and_thresholds(tmp_path):
    out = tmp_path / "plan.json"
    proc = rtx("plan", "--model", "dummy:tiny", "--scheduler", "sla-lanes", "--num-kv-blocks", "256",
                   "--max-num-seqs", "8", "--max-num-batched-tokens", "128", "--step-time", "20", "1",
                   "--lane-mix", "realtime=0.2,standard=0.8", "--requests", "300", "--loads", "0.5,0.8",
                   # Short answers: a simulation costs host time per step, and this checks the plan, not the lengths.
                   "--output-tokens", "realtime=4:8", "--output-tokens", "standard=8:16",
                   "--target-rate", "50", "--window", "4", "--windows", "3", "--json", str(out), timeout=600)
    assert proc.returncode == 0, proc.stderr
    assert "capacity (requests/s" in proc.stdout and "replicas for 50 requests/s:" in proc.stdout
    assert proc.stdout.count("TTFT p95 over 3 windows of 4 s: realtime ") == 2
    plan = json.loads(out.read_text())
    assert set(plan["capacity_per_lane"]) == {"realtime", "standard"}
    assert plan["capacity"] == min(plan["capacity_per_lane"].values()) > 0
    assert [round(p["rate"] / plan["capacity"], 3) for p in plan["predictions"]] == [0.5, 0.8]
    assert plan["replicas"] >= 50 / plan["capacity"]
    assert plan["autoscaling"]["queue_depth_per_pod"] >= 0
    for p in plan["predictions"]:
        assert p["windows"]["window_s"] == 4 and p["windows"]["count"] == 3
        for lane in ("realtime", "standard"):
            low, high = p["windows"]["lanes"][lane]["ttft_s"]["p95"]
            assert 0 < low <= high


@pytest.mark.parametrize("args, message", [
    ((), "give one step-time profile"),
    (("--step-time", "20", "1"), "KV block count is needed"),
    (("--step-time", "20", "1", "--num-kv-blocks", "64", "--loads", "half"), "--loads must be numbers"),
    (("--step-time", "20", "1", "--num-kv-blocks", "64", "--lane-mix", "vip=1", "--prompt-tokens", "vip=1:2",
      "--output-tokens", "vip=1:2"), "lane vip, which the config does not define"),
    (("--step-time", "0", "0", "--num-kv-blocks", "64"), "not both 0"),
    (("--step-time", "20", "1", "--num-kv-blocks", "64", "--requests", "10"), "--requests must be between 100"),
    (("--step-time", "20", "1", "--num-kv-blocks", "64", "--requests", "1000000000"),
     "--requests must be between 100 and 100,000"),
    (("--step-time", "20", "1", "--num-kv-blocks", "64", "--window", "0"), "--window must be > 0 seconds"),
    (("--step-time", "20", "1", "--num-kv-blocks", "64", "--window", "60", "--windows", "1"),
     "--windows must be between 2 and 100"),
    (("--step-time", "20", "1", "--num-kv-blocks", "64", "--windows", "4"), "--windows needs --window"),
    # Checked once the rates are known, after the capacity search: short requests keep that quick.
    (("--scheduler", "sla-lanes", "--step-time", "20", "1", "--num-kv-blocks", "64", "--window", "1e9",
      "--requests", "300", "--lane-mix", "standard=1", "--prompt-tokens", "standard=32:32", "--output-tokens",
      "standard=8:8"), "arrivals a sequence"),
    (("--step-time", "20", "1", "--num-kv-blocks", "64", "--lane-mix", "standard=1", "--prompt-tokens",
      "standard=3000:3000"), "cannot take a standard request of 3000 prompt"),
])
def test_rtx_plan_bad_input_is_one_line(args, message):
    proc = rtx("plan", "--model", "dummy:tiny", *args)
    # The window is judged against rates the capacity search finds: its lines come first.
    assert_one_line_error(proc, message, after_progress=message == "arrivals a sequence")


def test_rtx_plan_refuses_an_inter_token_target_below_one_decode_step(tmp_path):
    # Admission control refused nearly every realtime request at any rate: the plan read capacity 0.00686 and
    # thousands of replicas, an answer to a question no load can meet.
    config = tmp_path / "lanes.toml"
    config.write_text("[lanes.realtime]\nttft_target_s = 1.0\nitl_target_s = 0.05\n")
    proc = run_in_process("plan", "--model", "dummy:tiny", "--config", str(config), "--step-time", "71.87", "1.829",
                          "--num-kv-blocks", "64")
    assert_one_line_error(proc, "lane realtime's itl_target_s 0.05 s is below one decode step of this profile "
                                "(0.0737 s for a lone request)")


@pytest.mark.parametrize("text, message", [
    # nan and inf pass every ">= 0" check: the plan went on to a wrong diagnosis (no request could be scheduled).
    ('{"base_s": NaN, "per_token_s": 0.0001}', "base_s must be a finite number >= 0, got nan"),
    ('{"base_s": 0.01, "per_token_s": Infinity}', "per_token_s must be a finite number >= 0, got inf"),
    ('{"base_s": -0.01, "per_token_s": 0.0001}', "base_s must be a finite number >= 0, got -0.01"),
    ('{"base_s": 0.01, "per_token_s": 0.0001, "spread": [1, NaN]}', "spread must be a finite number >= 0, got nan"),
    ('{"base_s": 0.01, "per_token_s": "fast"}', "per_token_s must be a finite number >= 0, got 'fast'"),
    ('{"base_s": 0.01, "per_token_s": 0.0001, "ingress": 5}', "ingress must be a list of numbers, got 5"),
    ('{"base_s": 0.01, "per_token_s": 0.0001, "decode_s": {"one": 0.01}}', "decode_s must map batch sizes"),
    # Python's own words before: "list indices must be integers or slices, not str", "'base_s'".
    ("[0.01, 0.0001]", "must be a JSON object {base_s, per_token_s, ...}, got list"),
    ('{"per_token_s": 0.0001}', "has no base_s"),
    ('{"base_s": 0.01, "per_token_s": 0.0001, "per_row": 0.002}', "has unknown field 'per_row'"),
    ("{base_s: 0.01}", "is not JSON"),
])
def test_rtx_plan_names_the_profile_file_and_its_bad_field(tmp_path, text, message):
    path = tmp_path / "profile.json"
    path.write_text(text)
    proc = run_in_process("plan", "--model", "dummy:tiny", "--profile-file", str(path), "--num-kv-blocks", "64")
    assert_one_line_error(proc, message)
    assert str(path) in proc.stderr


def test_rtx_plan_takes_the_step_time_a_live_server_learnt(tmp_path):
    """``--profile-url``: the step-time profile the engine learnt from its own steps (whatever the scheduler: fcfs
    here), its spread, the serving path's seconds and the server's KV block count, read from its /metrics; a server
    that has not run enough steps yet says so in one line."""
    server = start_server("--no-grpc", "--model", "dummy:tiny", "--num-kv-blocks", "100")
    try:
        assert_one_line_error(rtx("plan", "--model", "dummy:tiny", "--profile-url", server.base_url),
                              "exports no learnt step time")
        # A URL that answers an error status: one line still (httpx's message has a second).
        proc = rtx("plan", "--model", "dummy:tiny", "--profile-url", server.base_url + "/nope")
        assert_one_line_error(proc, "404 Not Found")
        assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr
        # Enough back-to-back steps for the profile (50) and then its spread (50 more).
        threads = [threading.Thread(target=httpx.post, args=(server.base_url + "/v1/completions",),
                                    kwargs={"json": {"prompt": [5] * (8 + i), "max_tokens": 150, "ignore_eos": True},
                                            "timeout": 120}) for i in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        # Requests for the serving path's figures (20 at least) and for the spread of steps with a prefill in them
        # (50 at least: the six above gave a few), and the export is refreshed at most once a second.
        for i in range(max(PATH_MIN_SAMPLES, RECORDER_MIN_SAMPLES)):
            httpx.post(server.base_url + "/v1/completions", json={"prompt": [5] * 8 + [i], "max_tokens": 2},
                       timeout=60)
        time.sleep(PROFILE_EXPORT_INTERVAL_S)
        httpx.post(server.base_url + "/v1/completions", json={"prompt": [5] * 8, "max_tokens": 2}, timeout=60)
        out = tmp_path / "plan.json"
        proc = rtx("plan", "--model", "dummy:tiny", "--scheduler", "sla-lanes", "--profile-url", server.base_url,
                   "--lane-mix", "standard=1", "--requests", "200", "--loads", "0.5", "--output-tokens", "standard=4:8",
                   "--json", str(out), timeout=600)
        assert proc.returncode == 0, proc.stderr
        plan = json.loads(out.read_text())
        assert plan["num_kv_blocks"] == 100
        profile = plan["profile"]
        assert profile["source"].startswith("learnt by the server")
        assert profile["base_s"] + profile["per_token_s"] > 0
        for kind in ("spread", "decode_spread"):  # steps with a prefill chunk, and decodes
            spread = profile[kind]
            assert len(spread) == len(SPREAD_QUANTILES) and spread == sorted(spread) and spread[0] > 0, kind
            assert spread[0] <= 1.0 <= spread[-1], kind  # steps on both sides of the prediction
        # The serving side's seconds before and after the engine, as the server measured them.
        for part in ("ingress", "delivery"):
            values = profile[part]
            assert len(values) == len(SPREAD_QUANTILES) and values == sorted(values) and values[0] >= 0, part
        assert profile["ingress"][-1] > 0
    finally:
        assert server.stop() == 0, server.output()


def test_a_profile_measured_here_plans_and_plans_the_same_from_its_file(tmp_path):
    """``rtx plan --profile`` times real steps of the model on this machine (decode batches 1, 2, 4; prefill chunks
    of 32 to 128 tokens: six shapes), fits its line and plans with it; the profile written by ``--profile-out``
    read back with ``--profile-file`` gives the same plan (the simulation is seeded)."""
    common = ("plan", "--model", "dummy:tiny", "--scheduler", "sla-lanes", "--max-num-seqs", "4",
              "--max-num-batched-tokens", "128", "--lane-mix", "standard=1", "--requests", "200", "--loads", "0.5",
              "--output-tokens", "standard=4:8")
    profile_file, first, second = tmp_path / "profile.json", tmp_path / "first.json", tmp_path / "second.json"
    proc = rtx(*common, "--profile", "--profile-out", str(profile_file), "--json", str(first), timeout=600)
    assert proc.returncode == 0, proc.stderr
    assert "step-time profile from 6 step shapes" in proc.stdout + proc.stderr
    measured = json.loads(first.read_text())
    assert measured["profile"]["source"].startswith("measured here")
    assert measured["profile"]["base_s"] > 0 and measured["profile"]["per_token_s"] >= 0
    assert measured["num_kv_blocks"] > 1 and measured["capacity"] > 0
    proc = rtx(*common, "--profile-file", str(profile_file), "--num-kv-blocks", str(measured["num_kv_blocks"]),
               "--json", str(second), timeout=600)
    assert proc.returncode == 0, proc.stderr
    again = json.loads(second.read_text())
    assert again["profile"]["base_s"] == measured["profile"]["base_s"]
    assert again["capacity"] == measured["capacity"] and again["predictions"] == measured["predictions"]
