"""``rtx plan``: capacity per lane, the predicted latency at a few loads, the replicas a target rate needs and the
autoscaling thresholds, from the queueing model (rtxcore/capacity, docs/serving.md "Capacity planning")."""

from __future__ import annotations

import argparse
import datetime
import json
import math
import sys
from dataclasses import replace
from pathlib import Path

from rtxcore.capacity.step_time import SPREAD_QUANTILES
from rtxcore.cli.common import add_engine_options, engine_config, finite_float, http_url, output_file
from rtxcore.cli.loadgen import add_lane_mix_options, lane_profiles
from rtxcore.errors import ConfigError

# Arrivals one --window sequence may hold: each is simulated step by step, several times per rate (about a minute
# of host time for 100,000 here).
MAX_WINDOW_ARRIVALS = 100_000
# --windows when only --window is given (None there tells a --windows given without --window apart).
DEFAULT_WINDOWS = 8


def add_parser(sub) -> None:
    p = sub.add_parser(
        "plan", help="predict latency, capacity per lane, replicas and autoscaling thresholds (queueing model)",
        description="Simulate the engine (its real scheduler on a virtual clock, steps timed by a step-time profile) "
                    "under Poisson arrivals of a lane mix: each lane's capacity (the rate at which its p95 time to "
                    "first token first exceeds its target), predicted TTFT and inter-token latency at --loads of "
                    "the lowest capacity, the replicas --target-rate needs and the HPA thresholds to go with them.")
    add_engine_options(p)
    p.add_argument("--config", default=None, metavar="FILE",
                   help="the serve config file (lanes, their targets, [scheduler], [brownout]), as rtx serve takes it")
    g = p.add_argument_group("step-time profile (one of)")
    g.add_argument("--profile", action="store_true",
                   help="measure it here: load the model and time decode and prefill steps (also gives the KV "
                        "block count)")
    g.add_argument("--profile-url", type=http_url, default=None, metavar="URL",
                   help="read it from a running rtx serve after minutes of load: the step time its engine learnt "
                        "from its own steps and their spread (rtx_step_time_profile_seconds, "
                        "rtx_step_time_spread_ratio), the serving path's seconds (rtx_serving_path_seconds) and "
                        "its KV block count")
    g.add_argument("--profile-file", type=Path, default=None,
                   help="a JSON profile {base_s, per_token_s[, spread, ingress, delivery]} (e.g. the one "
                        "--profile-out wrote)")
    g.add_argument("--step-time", nargs=2, type=finite_float, default=None, metavar=("BASE_MS", "PER_TOKEN_MS"),
                   help="a step takes BASE_MS + PER_TOKEN_MS x tokens")
    g.add_argument("--profile-out", type=output_file, default=None, help="write the profile used as JSON")
    g = p.add_argument_group("load")
    add_lane_mix_options(g)
    g.add_argument("--loads", default="0.5,0.8,1.0",
                   help="predict at these multiples of the lowest lane capacity (default: 0.5,0.8,1.0)")
    g.add_argument("--rate", action="append", type=finite_float, default=[],
                   help="also predict at this arrival rate in requests/s (repeatable)")
    g.add_argument("--target-rate", type=finite_float, default=None,
                   help="requests/s the deployment must serve: sizes replicas")
    g.add_argument("--requests", type=int, default=3000,
                   help="simulated arrivals per prediction, 100 to 100,000 (default: 3000; the p99 of a lane with "
                        "a tenth of them rests on 3 requests)")
    g.add_argument("--seed", type=int, default=0, help="seed of arrival times, lanes and lengths")
    g.add_argument("--window", type=finite_float, default=None, metavar="SECONDS",
                   help="also give each figure's range over --windows Poisson sequences this long at each rate: "
                        "what one window of live load (an alert's, a benchmark's) can show")
    g.add_argument("--windows", type=int, default=None, help="sequences for --window, 2 to 100 (default: 8)")
    p.add_argument("--json", dest="json_path", type=output_file, default=None, help="also write the plan as JSON")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from rtxcore.capacity.planner import HEADROOM, Planner, replicas_for
    from rtxcore.capacity.profile import StepTimeProfile, from_server, measure
    from rtxcore.server.serve_config import load_serve_config

    def log(line: str) -> None:
        sys.stderr.write(line + "\n")

    given = [args.profile, args.profile_url is not None, args.profile_file is not None, args.step_time is not None]
    if sum(given) != 1:
        raise ConfigError("give one step-time profile: --profile, --profile-url URL, --profile-file FILE or "
                          "--step-time BASE_MS PER_TOKEN_MS")
    loads = _loads(args.loads)
    if not 100 <= args.requests <= MAX_WINDOW_ARRIVALS:  # the same bound as a window's, for the same reason
        raise ConfigError(f"--requests must be between 100 and {MAX_WINDOW_ARRIVALS:,}, got {args.requests}")
    if args.target_rate is not None and args.target_rate <= 0:
        raise ConfigError(f"--target-rate must be > 0, got {args.target_rate:g}")
    if any(r <= 0 for r in args.rate):
        raise ConfigError("--rate must be > 0")
    if args.window is not None and args.window <= 0:
        raise ConfigError(f"--window must be > 0 seconds, got {args.window:g}")
    if args.windows is not None and args.window is None:
        raise ConfigError("--windows needs --window SECONDS")
    if args.windows is not None and not 2 <= args.windows <= 100:
        raise ConfigError(f"--windows must be between 2 and 100, got {args.windows}")
    config_file = load_serve_config(args.config)
    served = engine_config(args, config_file)
    served.scheduling.lanes = config_file.lanes
    served.scheduling.options = config_file.scheduler_options
    mix = lane_profiles(args)
    unknown = sorted({m.name for m in mix} - set(served.scheduling.lanes))
    if unknown:
        raise ConfigError(f"--lane-mix names lane {unknown[0]}, which the config does not define")
    if args.profile:
        log(f"measuring the step-time profile of {served.model or 'the default model'} here...")
        profile, blocks = measure(served, log=log)
        if served.num_kv_blocks is None:
            served = replace(served, num_kv_blocks=blocks)
    elif args.profile_url is not None:
        profile, blocks = from_server(args.profile_url, served.block_size)
        if served.num_kv_blocks is None:
            served = replace(served, num_kv_blocks=blocks)
    elif args.profile_file is not None:
        profile = StepTimeProfile.load(args.profile_file)
    else:
        base_ms, per_token_ms = args.step_time
        if base_ms < 0 or per_token_ms < 0 or base_ms + per_token_ms == 0:
            raise ConfigError("--step-time values must be >= 0, and not both 0")
        profile = StepTimeProfile(base_ms / 1000, per_token_ms / 1000)
    if served.num_kv_blocks is None:
        raise ConfigError("the KV block count is needed: give --num-kv-blocks (what rtx serve logs at start) or "
                          "--profile")
    if args.profile_out:
        Path(args.profile_out).write_text(json.dumps(profile.to_json(), indent=2) + "\n")
    _check_targets_reachable(served.scheduling.lanes, [m.name for m in mix], profile)
    planner = Planner(served, profile, mix, args.requests, args.seed, log)
    capacities = {m.name: planner.capacity(m.name) for m in mix}
    capacity = min(capacities.values())
    if not math.isfinite(capacity):
        raise ConfigError("no lane ever misses its target in the simulation (a step-time profile near 0?): no "
                          "capacity to plan from")
    predictions = [planner.predict(load * capacity) for load in loads] + [planner.predict(r) for r in args.rate]
    at_headroom = planner.predict(HEADROOM * capacity)
    predicted = [p.to_json() for p in predictions]
    if args.window is not None:
        most = max(p.rate for p in predictions) * args.window
        if most > MAX_WINDOW_ARRIVALS:
            raise ConfigError(f"--window {args.window:g} s is {most:.0f} arrivals a sequence at the highest rate; "
                              f"at most {MAX_WINDOW_ARRIVALS}")
        count = args.windows or DEFAULT_WINDOWS
        for p, row in zip(predictions, predicted):
            log(f"{count} windows of {args.window:g} s at {p.rate:.3g} requests/s...")
            row["windows"] = planner.windows(p.rate, args.window, count).to_json()
    report = {
        "command": "rtx " + " ".join(sys.argv[1:]),
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "profile": profile.to_json(), "num_kv_blocks": served.num_kv_blocks,
        "max_num_seqs": served.scheduling.max_num_seqs,
        "max_num_batched_tokens": served.scheduling.max_num_batched_tokens,
        "simulated_requests": args.requests, "seed": args.seed,
        "capacity_per_lane": capacities, "capacity": capacity,
        "predictions": predicted,
        "autoscaling": {"replica_share_of_capacity": HEADROOM,
                        "queue_depth_per_pod": round(at_headroom.mean_waiting, 2),
                        "ttft_p95_s": {k: v.ttft_s["p95"] for k, v in at_headroom.lanes.items()}},
    }
    if args.target_rate is not None:
        report["target_rate"] = args.target_rate
        report["replicas"] = replicas_for(args.target_rate, capacity)
    print(_render(report))
    if args.json_path:
        Path(args.json_path).write_text(json.dumps(report, indent=2) + "\n")
    return 0


def _check_targets_reachable(lanes, names: list[str], profile) -> None:
    """Refuse a lane whose inter-token target is below one decode step of a lone request: admission control would
    refuse nearly all of its requests at any rate, and the plan came out as a capacity near 0 and thousands of
    replicas, which reads as an answer rather than as a target no load can meet.

    :raises ConfigError: naming the lane, its target and the step's time.
    """
    step_s = profile.seconds(1, 1)
    for name in names:
        target = lanes[name].itl_target_s
        if target < step_s:
            raise ConfigError(f"lane {name}'s itl_target_s {target:g} s is below one decode step of this profile "
                              f"({step_s:.3g} s for a lone request): no rate meets it; raise the target, or plan "
                              "with a faster machine's profile")


def _loads(text: str) -> list[float]:
    try:
        loads = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ConfigError(f"--loads must be numbers separated by commas, got {text!r}") from None
    if not loads or any(not (load > 0 and math.isfinite(load)) for load in loads):
        raise ConfigError(f"--loads must be positive numbers, got {text!r}")
    return loads


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1000:.0f}"


def _median_ms(quantiles: list[float]) -> str:
    return f"{quantiles[SPREAD_QUANTILES.index(0.5)] * 1000:.1f}" if quantiles else "-"


def _render(report: dict) -> str:
    p = report["profile"]
    per_row = f" + {p['per_row_s'] * 1000:.3f} ms/request" if p.get("per_row_s") else ""
    lines = [f"step time {p['base_s'] * 1000:.2f} ms + {p['per_token_s'] * 1000:.3f} ms/token{per_row} "
             f"({p['source']}); "
             f"{report['num_kv_blocks']} KV blocks, {report['max_num_seqs']} sequences, "
             f"{report['max_num_batched_tokens']} tokens a step",
             *([f"serving path (median, ms): ingress {_median_ms(p['ingress'])}, delivery "
                f"{_median_ms(p['delivery'])}, added to each TTFT"] if p.get("ingress") else []),
             "capacity (requests/s at which the lane's p95 TTFT first exceeds its target): "
             + ", ".join(f"{k} {v:.3g}" for k, v in report["capacity_per_lane"].items()),
             "",
             f"{'rate/s':>8} {'util':>5} {'queue':>6}  {'lane':<9} {'TTFT p50':>9} {'p95':>7} {'p99':>7} "
             f"{'ITL p50':>8} {'p95':>6} {'p99':>6} {'refused':>7}  (ms)"]
    for pred in report["predictions"]:
        first = True
        for lane, lp in pred["lanes"].items():
            head = (f"{pred['rate']:>8.3g} {pred['utilization']:>5.2f} {pred['mean_waiting']:>6.1f}" if first
                    else " " * 21)
            first = False
            t, i = lp["ttft_s"], lp["itl_s"]
            lines.append(f"{head}  {lane:<9} {_ms(t['p50']):>9} {_ms(t['p95']):>7} {_ms(t['p99']):>7} "
                         f"{_ms(i['p50']):>8} {_ms(i['p95']):>6} {_ms(i['p99']):>6} {lp['refused']:>7}")
        if "windows" in pred:
            w = pred["windows"]
            lines.append(" " * 23 + f"TTFT p95 over {w['count']} windows of {w['window_s']:g} s: " + ", ".join(
                f"{lane} " + (f"{_ms(f['ttft_s']['p95'][0])}-{_ms(f['ttft_s']['p95'][1])}" if "p95" in f["ttft_s"]
                              else "-") for lane, f in w["lanes"].items()) + " ms")
    a = report["autoscaling"]
    lines += ["", f"autoscaling at {a['replica_share_of_capacity']:.0%} of capacity: scale out above "
                  f"{a['queue_depth_per_pod']} requests waiting per pod, or a lane's p95 TTFT above "
                  + ", ".join(f"{k} {_ms(v)} ms" for k, v in a["ttft_p95_s"].items())]
    if "replicas" in report:
        lines.append(f"replicas for {report['target_rate']:g} requests/s: {report['replicas']}")
    return "\n".join(lines)
