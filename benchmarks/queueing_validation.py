"""The queueing model (rtxcore/capacity) against live load on this machine: `rtx serve` with the sla-lanes scheduler
and W5's CPU lanes (benchmarks/w5_cpu.toml), `rtx loadgen` at fractions of its measured capacity (Poisson, the W5
mix scaled to 2 cores as benchmarks/w5_cpu.sh runs it), and the model's prediction at the same arrival rates beside
each measured figure.

Usage: python benchmarks/queueing_validation.py [--loads 0.5,0.8,1.0] [--duration 120] [--json OUT]

Two step-time profiles, each giving its own predictions: one measured first, in this process, with the server not
yet started (``rtx plan --profile``), and the one the server's scheduler learnt from its own steps during each load
phase, read from its /metrics right after it (``rtx plan --profile-url``).
Measured TTFT is the client's (send to first streamed token: HTTP, tokenization and the stream included); ITL pools
every gap of every completed request, as `rtx loadgen` reports them.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import subprocess
import sys
import time
from pathlib import Path

import httpx

from rtxcore.bench.loadgen import LaneProfile, LengthRange, LoadgenConfig, run_loadgen_sync
from rtxcore.capacity.planner import Planner
from rtxcore.capacity.profile import from_server, measure
from rtxcore.contracts.scheduler import SchedulerConfig
from rtxcore.engine.config import EngineConfig
from rtxcore.server.serve_config import load_serve_config

REPO = Path(__file__).resolve().parent.parent
CONFIG = REPO / "benchmarks" / "w5_cpu.toml"
MIX = (LaneProfile("realtime", 0.1, LengthRange(16, 32), LengthRange(8, 16)),
       LaneProfile("standard", 0.6, LengthRange(32, 96), LengthRange(16, 32)),
       LaneProfile("bulk", 0.3, LengthRange(96, 192), LengthRange(32, 64)))
MAX_NUM_SEQS, MAX_NUM_BATCHED_TOKENS, PORT = 16, 256, 8377


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--loads", default="0.5,0.8,1.0")
    ap.add_argument("--duration", type=float, default=120.0, help="seconds of arrivals per load (default: 120)")
    ap.add_argument("--plan-requests", type=int, default=3000, help="simulated arrivals per prediction (3000)")
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
    server = subprocess.Popen([sys.executable, "-m", "rtxcore.cli.main", "serve", "--port", str(PORT), "--no-grpc",
                               "--scheduler", "sla-lanes", "--config", str(CONFIG), "--max-num-seqs",
                               str(MAX_NUM_SEQS), "--max-num-batched-tokens", str(MAX_NUM_BATCHED_TOKENS),
                               "--num-kv-blocks", str(blocks)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{PORT}"
    try:
        for _ in range(300):
            try:
                if httpx.get(url + "/ready", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(1)
        measured, learnt, capacity = [], [], None
        for i, load in enumerate(loads):
            config = LoadgenConfig(url=url, duration_s=args.duration, load=load, capacity=capacity, lanes=MIX,
                                   capacity_clients=16, capacity_duration_s=40, seed=10 + i,
                                   request_timeout_s=600)
            report = run_loadgen_sync(config, log)
            capacity = report.capacity
            measured.append(report)
            learnt.append(from_server(url, 16)[0])
            log(f"learnt by the server at {load}x: {learnt[-1].base_s * 1000:.1f} ms + "
                f"{learnt[-1].per_token_s * 1000:.2f} ms/token")
            time.sleep(10)
    finally:
        server.terminate()
        server.wait(60)
    planner = Planner(served, profile, MIX, requests=args.plan_requests, seed=1, log=log)
    rows = []
    print(f"# python benchmarks/queueing_validation.py {' '.join(sys.argv[1:])}")
    print(f"# {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, {platform.machine()}, "
          f"{profile.base_s * 1000:.1f} ms + {profile.per_token_s * 1000:.2f} ms/token, {blocks} KV blocks, "
          f"capacity {capacity:.3f} requests/s (closed loop, 16 clients)")
    print(f"{'load':>5} {'rate':>6} {'lane':<9} {'figure':<9} {'measured':>9} {'in-proc':>8} {'ratio':>6} "
          f"{'learnt':>8} {'ratio':>6}")
    for load, report, live in zip(loads, measured, learnt):
        prediction = planner.predict(report.offered_rate)
        live_planner = Planner(served, live, MIX, requests=planner.requests, seed=1)
        live_prediction = live_planner.predict(report.offered_rate)
        print(f"# at {load}x the server had learnt {live.base_s * 1000:.1f} ms + "
              f"{live.per_token_s * 1000:.2f} ms/token")
        for lane in report.lanes:
            p, q = prediction.lanes.get(lane.name), live_prediction.lanes.get(lane.name)
            if p is None or q is None:
                continue
            for figure, key, quantile in (("TTFT p50", "ttft_s", 50), ("TTFT p95", "ttft_s", 95),
                                          ("ITL p50", "itl_s", 50), ("ITL p95", "itl_s", 95)):
                meas = getattr(lane, key)[quantile]
                pred, pred_live = getattr(p, key)[f"p{quantile}"], getattr(q, key)[f"p{quantile}"]
                ratio = pred / meas if pred and meas else None
                ratio_live = pred_live / meas if pred_live and meas else None
                rows.append({"load": load, "rate": report.offered_rate, "lane": lane.name, "figure": figure,
                             "measured_s": meas, "predicted_s": pred, "ratio": ratio,
                             "predicted_learnt_s": pred_live, "ratio_learnt": ratio_live})
                print(f"{load:>5.2f} {report.offered_rate:>6.3f} {lane.name:<9} {figure:<9} {_s(meas):>9} "
                      f"{_s(pred):>8} {_r(ratio):>6} {_s(pred_live):>8} {_r(ratio_live):>6}")
    if args.json:
        Path(args.json).write_text(json.dumps({"profile": profile.to_json(), "capacity": capacity, "rows": rows},
                                              indent=2))
    return 0


def _r(value):
    return "-" if value is None else f"{value:.2f}"


def _s(value):
    return "-" if value is None else f"{value:.3f}"


if __name__ == "__main__":
    sys.exit(main())
