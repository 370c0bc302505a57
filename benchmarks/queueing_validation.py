"""The queueing model (rtxcore/capacity) against live load on this machine: `rtx serve` with the sla-lanes scheduler
and W5's CPU lanes (benchmarks/w5_cpu.toml), `rtx loadgen` at fractions of its capacity (Poisson, the W5 mix scaled
to 2 cores as benchmarks/w5_cpu.sh runs it), and the model's prediction at the same arrival rates beside each
measured figure. The capacity is the issue's and `rtx plan`'s: the lowest arrival rate at which a lane's p95 time to
first token exceeds its target (or 1% of its requests are refused), found by the model on the profile the server
learnt during a closed-loop phase (16 clients, 40 s); `--capacity throughput` takes that phase's throughput instead.

Usage: python benchmarks/queueing_validation.py [--loads 0.5,0.8,1.0] [--duration 120] [--capacity lanes] [--json OUT]

Two step-time profiles: one measured first, in this process, with the server not yet started (``rtx plan
--profile``: a line, no spread), and the one the server's engine learnt from its own steps up to the end of each
load phase, spread included, read from its /metrics right after it (``rtx plan --profile-url``). Three predictions
per figure: the in-process profile and the learnt one at the phase's arrival rate (fresh Poisson arrivals, as `rtx
plan` predicts), and the learnt one on the very requests the phase sent (its plan: times, lanes, lengths).
Beside them, the range of each figure over REALIZATIONS other Poisson sequences as long as the phase (the learnt
profile, other seeds): what one live run of that length can show at that rate, so that a measured figure outside
the model's 10% but inside that range is told apart from one the model cannot produce.
Measured TTFT is the client's (send to first streamed token: HTTP, the stream and the load generator's process
included) and the engine's (submission to first token, from the server's request timelines: what the model
simulates); ITL pools every gap of every completed request, as `rtx loadgen` reports them.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from rtxcore.bench.loadgen import LaneProfile, LengthRange, LoadgenConfig, run_loadgen_sync
from rtxcore.bench.loadgen.stats import percentile
from rtxcore.bench.loadgen.workload import plan_requests
from rtxcore.capacity.planner import Planner, summarize
from rtxcore.capacity.profile import from_server, measure
from rtxcore.capacity.simulation import arrivals_of, simulate
from rtxcore.contracts.scheduler import SchedulerConfig
from rtxcore.engine.config import EngineConfig
from rtxcore.metrics.timeline import read_timelines
from rtxcore.server.serve_config import load_serve_config

REPO = Path(__file__).resolve().parent.parent
CONFIG = REPO / "benchmarks" / "w5_cpu.toml"
MIX = (LaneProfile("realtime", 0.1, LengthRange(16, 32), LengthRange(8, 16)),
       LaneProfile("standard", 0.6, LengthRange(32, 96), LengthRange(16, 32)),
       LaneProfile("bulk", 0.3, LengthRange(96, 192), LengthRange(32, 64)))
MAX_NUM_SEQS, MAX_NUM_BATCHED_TOKENS, PORT = 16, 256, 8377
# Arrival sequences of a phase's length simulated for the range one live run can show (a few seconds each).
REALIZATIONS = 8


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--loads", default="0.5,0.8,1.0")
    ap.add_argument("--duration", type=float, default=120.0, help="seconds of arrivals per load (default: 120)")
    ap.add_argument("--plan-requests", type=int, default=3000, help="simulated arrivals per prediction (3000)")
    ap.add_argument("--capacity", choices=("lanes", "throughput"), default="lanes",
                    help="what the loads are fractions of: the lowest lane's capacity in the model, as `rtx plan` "
                         "gives it (default), or the closed-loop throughput `rtx loadgen` measures")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    loads = [float(x) for x in args.loads.split(",")]
    config_file = load_serve_config(str(CONFIG))
    served = EngineConfig(scheduler="sla-lanes", scheduling=SchedulerConfig(
        max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS, max_num_seqs=MAX_NUM_SEQS, lanes=config_file.lanes,
        options=config_file.scheduler_options))
    log = lambda line: print(line, file=sys.stderr, flush=True)  # noqa: E731
    profile, blocks = measure(served, log=log)
    served.num_kv_blocks = blocks
    server_log = tempfile.NamedTemporaryFile("w+", prefix="rtx-serve-", suffix=".log")
    server = subprocess.Popen([sys.executable, "-m", "rtxcore.cli.main", "serve", "--port", str(PORT), "--no-grpc",
                               "--scheduler", "sla-lanes", "--config", str(CONFIG), "--max-num-seqs",
                               str(MAX_NUM_SEQS), "--max-num-batched-tokens", str(MAX_NUM_BATCHED_TOKENS),
                               "--num-kv-blocks", str(blocks)],
                              stdout=subprocess.DEVNULL, stderr=server_log)
    url = f"http://127.0.0.1:{PORT}"
    phases = []  # (load, loadgen config, report, learnt profile, phase start as Unix time)
    try:
        for _ in range(300):
            try:
                if httpx.get(url + "/ready", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(1)
        throughput = run_loadgen_sync(LoadgenConfig(url=url, lanes=MIX, capacity_clients=16, capacity_duration_s=40,
                                                    duration_s=1, load=0.1), log).capacity
        assert throughput is not None
        # The issue's and `rtx plan`'s capacity: the lowest rate at which a lane misses its target, in the model, on
        # the profile the server learnt during the closed-loop phase. Loads are fractions of it unless asked for
        # fractions of the closed-loop throughput.
        learnt, _ = from_server(url, 16)
        lane_planner = Planner(served, learnt, MIX, requests=args.plan_requests, seed=1, log=log)
        lane_capacities = {lane.name: lane_planner.capacity(lane.name) for lane in MIX}
        capacity = throughput if args.capacity == "throughput" else min(lane_capacities.values())
        if not math.isfinite(capacity):
            raise SystemExit("no lane ever misses its target in the model: no capacity to take fractions of")
        log(f"closed-loop throughput {throughput:.3f} requests/s; lanes' capacities "
            f"{ {k: round(v, 3) for k, v in lane_capacities.items()} }; loads are fractions of {capacity:.3f}")
        for i, load in enumerate(loads):
            # Logprobs name each chunk's tokens: the first token is timed when it comes, not when text first does
            # (the detokenizer holds back a token that ends inside a character).
            config = LoadgenConfig(url=url, duration_s=args.duration, load=load, capacity=capacity, lanes=MIX,
                                   seed=10 + i, request_timeout_s=600, logprobs=True)
            started = time.time()
            report = run_loadgen_sync(config, log)
            live = from_server(url, 16)[0]
            phases.append((load, config, report, live, (started, time.time())))
            log(f"learnt by the server at {load}x: {live.base_s * 1000:.1f} ms + {live.per_token_s * 1000:.2f} "
                f"ms/token + {live.per_row_s * 1000:.2f} ms/request, {_spreads(live)}, "
                f"serving path (ms) ingress "
                f"{[round(x * 1000, 1) for x in live.ingress]} delivery {[round(x * 1000, 1) for x in live.delivery]}")
            time.sleep(10)
    finally:
        server.terminate()
        server.wait(60)
    server_log.seek(0)
    timelines = read_timelines(server_log)
    planner = Planner(served, profile, MIX, requests=args.plan_requests, seed=1, log=log)
    rows = []
    print(f"# python benchmarks/queueing_validation.py {' '.join(sys.argv[1:])}")
    print(f"# {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, {platform.machine()}, "
          f"{profile.base_s * 1000:.1f} ms + {profile.per_token_s * 1000:.2f} ms/token, {blocks} KV blocks, "
          f"closed-loop throughput {throughput:.3f} requests/s (16 clients), lanes' capacities "
          f"{ {k: round(v, 3) for k, v in lane_capacities.items()} }: loads are fractions of {capacity:.3f}")
    print(f"{'load':>5} {'rate':>6} {'lane':<9} {'figure':<9} {'client':>7} {'engine':>7} {'in-proc':>8} "
          f"{'learnt':>7} {'trace':>7}   ratios to the engine's figure (TTFT) or the client's (ITL); then "
          f"the learnt profile's range over {REALIZATIONS} other arrival sequences of the phase's length")
    for load, config, report, live, (started, ended) in phases:
        predictions = {
            "in_process": planner.predict(report.offered_rate),
            "learnt": Planner(served, live, MIX, requests=planner.requests, seed=1).predict(report.offered_rate),
            "learnt_trace": summarize(report.offered_rate, simulate(
                served, live, arrivals_of(plan_requests(config, report.offered_rate)), seed=1)),
        }
        # The planner's other sequences (`rtx plan --window`): arrivals seeded 100 + k, steps' draws k.
        windows = Planner(served, live, MIX, seed=0).windows(report.offered_rate, args.duration, REALIZATIONS)
        print(f"# at {load}x the server had learnt {live.base_s * 1000:.1f} ms + "
              f"{live.per_token_s * 1000:.2f} ms/token, {_spreads(live)}")
        for lane in report.lanes:
            # The phase's own requests: submitted after it started and before it ended (its last ones finished).
            engine_ttfts = [t["ttft_s"] for t in timelines if t.get("lane") == lane.name
                            and started <= t["enqueue"] <= ended and t.get("ttft_s") is not None]
            for figure, key, quantile in (("TTFT p50", "ttft_s", 50), ("TTFT p95", "ttft_s", 95),
                                          ("ITL p50", "itl_s", 50), ("ITL p95", "itl_s", 95)):
                client = getattr(lane, key)[quantile]
                engine = percentile(engine_ttfts, quantile) if key == "ttft_s" else None
                row = {"load": load, "rate": report.offered_rate, "lane": lane.name, "figure": figure,
                       "client_s": client, "engine_s": engine}
                base = engine if engine is not None else client
                for name, prediction in predictions.items():
                    predicted = getattr(prediction.lanes[lane.name], key)[f"p{quantile}"] \
                        if lane.name in prediction.lanes else None
                    row[f"{name}_s"] = predicted
                    row[f"{name}_ratio"] = predicted / base if predicted and base else None
                drawn = windows.lanes.get(lane.name, {}).get(key, {}).get(f"p{quantile}")
                row["realizations_range_s"] = list(drawn) if drawn else []
                row["inside_realizations"] = drawn is not None and base is not None and drawn[0] <= base <= drawn[1]
                rows.append(row)
                print(f"{load:>5.2f} {report.offered_rate:>6.3f} {lane.name:<9} {figure:<9} {_s(client):>7} "
                      f"{_s(engine):>7} " + " ".join(f"{_s(row[n + '_s'])}/{_r(row[n + '_ratio'])}"
                                                       for n in predictions)
                      + (f"  {_s(drawn[0])}-{_s(drawn[1])}" if drawn else ""))
    if args.json:
        Path(args.json).write_text(json.dumps({"profile": profile.to_json(), "capacity": capacity,
                                               "throughput": throughput, "lane_capacities": lane_capacities,
                                               "rows": rows,
                                               "learnt": [live.to_json() for *_, live, _ in phases]}, indent=2))
    return 0


def _r(value):
    return "-" if value is None else f"{value:.2f}"


def _s(value):
    return "-" if value is None else f"{value:.3f}"


def _spreads(profile):
    return (f"spread of decodes {[round(r, 2) for r in profile.decode_spread]}, "
            f"of the other steps {[round(r, 2) for r in profile.spread]}")


if __name__ == "__main__":
    sys.exit(main())
