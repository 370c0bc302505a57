"""``rtx loadgen``: open-loop load on a running server by lane and tenant, reported per lane (workload W5)."""

from __future__ import annotations

import argparse
import datetime
import json
import sys

from rtxcore.bench.loadgen.workload import MAX_CONNECTIONS
from rtxcore.cli.common import bounded_int, finite_float, http_url, non_empty, output_file
from rtxcore.cli.progress import Progress
from rtxcore.errors import ConfigError


def add_parser(sub) -> None:
    p = sub.add_parser(
        "loadgen", help="offer open-loop load to a running server and report latency and goodput per lane (W5)",
        description="Send streaming completions to a running `rtx serve` at Poisson or spiky arrival times over a "
                    "mix of lanes and tenants; report per lane TTFT and inter-token latency p50/p95/p99, goodput, "
                    "429s, 5xx and lost requests. Capacity is measured first when --load is used.")
    p.add_argument("--url", type=http_url, default="http://127.0.0.1:8000",
                   help="server base URL (default: http://127.0.0.1:8000)")
    p.add_argument("--duration", type=finite_float, default=30.0, help="seconds of arrivals (default: 30)")
    g = p.add_argument_group("rate")
    g.add_argument("--rate", type=finite_float, default=None, help="base arrival rate in requests/s")
    g.add_argument("--load", type=finite_float, default=None,
                   help="base arrival rate as a multiple of capacity (default: 1.0 when --rate is not given)")
    g.add_argument("--capacity", type=finite_float, default=None,
                   help="capacity in completed requests/s, skipping its measurement")
    g.add_argument("--capacity-clients", type=bounded_int(1, MAX_CONNECTIONS), default=8,
                   help=f"closed-loop clients while measuring capacity, at most {MAX_CONNECTIONS} (default: 8)")
    g.add_argument("--capacity-duration", type=finite_float, default=20.0,
                   help="seconds of capacity measurement (default: 20)")
    g = p.add_argument_group("arrivals")
    g.add_argument("--pattern", choices=["poisson", "spiky"], default="poisson", help="arrival pattern")
    g.add_argument("--spike-factor", type=finite_float, default=None, help="rate multiplier inside spikes (default: 3)")
    g.add_argument("--spike-len", type=finite_float, default=None, help="seconds each spike lasts (default: 10)")
    g.add_argument("--spike-period", type=finite_float, default=None,
                   help="seconds from one spike to the next (default: 60)")
    g.add_argument("--spike-start", type=finite_float, default=None,
                   help="seconds before the first spike (default: 20)")
    g.add_argument("--seed", type=int, default=0, help="seed of arrival times, lanes, tenants and lengths")
    g = p.add_argument_group("requests")
    add_lane_mix_options(g)
    g.add_argument("--tenant", action="append", default=[], metavar="NAME=KEY[:WEIGHT]",
                   help="a tenant and its API key, sent as a Bearer token (repeatable; none: no Authorization)")
    g.add_argument("--target", action="append", default=[], metavar="LANE=TTFT_S:ITL_S",
                   help="lane targets for goodput when the server has no GET /v1/lanes (repeatable; defaults: "
                        "realtime 1:0.25, standard 4:0.5, bulk 30:2)")
    g.add_argument("--token-ids", default="100:500", metavar="LOW:HIGH",
                   help="prompt token ids are drawn from [LOW, HIGH) (default: 100:500, valid for every built-in "
                        "model)")
    g.add_argument("--logprobs", action="store_true",
                   help="ask for logprobs so chunks carry tokens: TTFT is then the first token's, not the first "
                        "text's (which may come a token later); needed to time models without a tokenizer (dummy:*)")
    g.add_argument("--model", type=non_empty, default=None, help="model id to send (default: none, the served model)")
    g.add_argument("--timeout", type=finite_float, default=60.0,
                   help="seconds a request may take from send to end of stream before it counts as lost "
                        "(default: 60)")
    g.add_argument("--metrics-interval", type=finite_float, default=0.5,
                   help="seconds between polls of GET /metrics for rtx_brownout_level (default: 0.5)")
    p.add_argument("--json", dest="json_path", type=output_file, default=None,
                   help="also write the report as JSON to this file")
    p.set_defaults(run=run)


def add_lane_mix_options(g) -> None:
    """--lane-mix, --prompt-tokens and --output-tokens: the lanes of the load (``rtx loadgen``, ``rtx plan``)."""
    g.add_argument("--lane-mix", default="realtime=0.1,standard=0.6,bulk=0.3",
                   help="LANE=WEIGHT,... (default: realtime=0.1,standard=0.6,bulk=0.3)")
    g.add_argument("--prompt-tokens", action="append", default=[], metavar="LANE=LOW:HIGH",
                   help="prompt length range of a lane, uniform (repeatable; defaults: realtime 16:64, standard "
                        "32:128, bulk 128:256)")
    g.add_argument("--output-tokens", action="append", default=[], metavar="LANE=LOW:HIGH",
                   help="output length range of a lane, uniform (repeatable; defaults: realtime 16:32, standard "
                        "32:96, bulk 64:128)")


def run(args: argparse.Namespace) -> int:
    from rtxcore.bench.loadgen import Outcome, run_loadgen_sync

    config = loadgen_config(args)
    def log(line: str) -> None:
        sys.stderr.write(line + "\n")

    # Requests of the load phase that ended, on stderr with the phases' lines: stdout carries the report alone.
    report = run_loadgen_sync(config, log=log, progress=Progress("load", unit="req"))
    print(report.table())
    if args.json_path:
        command = "rtx " + " ".join(sys.argv[1:]) if sys.argv[1:2] == ["loadgen"] else "rtx loadgen"
        payload = {"command": command,
                   "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
                   **report.to_json()}
        with open(args.json_path, "w") as fh:
            json.dump(payload, fh, indent=2)
    # Lost and 5xx are never acceptable (issue 7): a script running the load can rely on the exit code.
    failed = report.overall.count(Outcome.LOST) + report.overall.count(Outcome.ERROR_5XX)
    if failed:
        sys.stderr.write(f"rtx loadgen: {failed} requests lost or answered 5xx\n")
    return 1 if failed else 0


def loadgen_config(args: argparse.Namespace):
    """The :class:`LoadgenConfig` the options describe; :class:`ConfigError` names the option that is wrong."""
    from rtxcore.bench.loadgen import LoadgenConfig
    from rtxcore.bench.loadgen.workload import check_plan_size

    config = LoadgenConfig(
        url=args.url, duration_s=args.duration, rate=args.rate, load=args.load, capacity=args.capacity,
        pattern=_pattern(args), lanes=lane_profiles(args), targets=_targets(args.target), tenants=_tenants(args.tenant),
        capacity_clients=args.capacity_clients, capacity_duration_s=args.capacity_duration,
        request_timeout_s=args.timeout, metrics_interval_s=args.metrics_interval, seed=args.seed,
        token_id_range=_int_pair(args.token_ids, "--token-ids"), logprobs=args.logprobs, model=args.model)
    # The load phase's size where its rate is known before the run, refused before any work (plan_requests refuses
    # one from a measured capacity, once it is measured).
    if config.rate is not None:
        rate, given = config.rate, f"--rate {config.rate:g}"
    elif config.capacity is not None and config.load is not None:
        rate, given = config.capacity * config.load, f"--load {config.load:g} x --capacity {config.capacity:g}"
    else:
        return config
    check_plan_size(config, rate, given)
    return config


def _pattern(args: argparse.Namespace):
    from rtxcore.bench.loadgen import PoissonArrivals, SpikyArrivals

    spike = {"factor": args.spike_factor, "spike_len_s": args.spike_len, "period_s": args.spike_period,
             "start_s": args.spike_start}
    given = {k: v for k, v in spike.items() if v is not None}
    if args.pattern == "poisson":
        if given:
            raise ConfigError("--spike-factor, --spike-len, --spike-period and --spike-start need --pattern spiky")
        return PoissonArrivals()
    return SpikyArrivals(**given)


def lane_profiles(args: argparse.Namespace):
    """The lane mix of --lane-mix, --prompt-tokens and --output-tokens (also ``rtx plan``'s)."""
    from rtxcore.bench.loadgen import DEFAULT_LANES, LaneProfile

    defaults = {lane.name: lane for lane in DEFAULT_LANES}
    weights = {}
    for name, value in _assignments([args.lane_mix] if args.lane_mix else [], "--lane-mix", "LANE=WEIGHT,...",
                                    split_commas=True):
        weights[name] = _number(value, f"--lane-mix {name}")
    if not weights or not any(w > 0 for w in weights.values()):
        raise ConfigError("--lane-mix needs at least one lane with a weight > 0")
    prompt = dict(_assignments(args.prompt_tokens, "--prompt-tokens", "LANE=LOW:HIGH"))
    output = dict(_assignments(args.output_tokens, "--output-tokens", "LANE=LOW:HIGH"))
    for flag, ranges in (("--prompt-tokens", prompt), ("--output-tokens", output)):
        stray = sorted(set(ranges) - set(weights))
        if stray:
            raise ConfigError(f"{flag} names lane {stray[0]}, which is not in --lane-mix")
    lanes = []
    for name, weight in weights.items():
        if weight < 0:
            raise ConfigError(f"--lane-mix {name}: weight must be >= 0, got {weight:g}")
        if weight == 0:  # lets a lane be switched off without retyping the others
            continue
        default = defaults.get(name)
        if default is None and (name not in prompt or name not in output):
            raise ConfigError(f"lane {name} has no default lengths: give --prompt-tokens {name}=LOW:HIGH and "
                              f"--output-tokens {name}=LOW:HIGH")
        lanes.append(LaneProfile(
            name, weight,
            # A lane without defaults has both ranges given (checked above).
            (_length_range(prompt[name], f"--prompt-tokens {name}") if name in prompt or default is None
             else default.prompt_tokens),
            (_length_range(output[name], f"--output-tokens {name}") if name in output or default is None
             else default.output_tokens)))
    return tuple(lanes)


def _targets(values: list[str]):
    from rtxcore.bench.loadgen import DEFAULT_TARGETS, LaneTarget

    targets = dict(DEFAULT_TARGETS)
    for name, value in _assignments(values, "--target", "LANE=TTFT_S:ITL_S"):
        ttft, sep, itl = value.partition(":")
        if not sep:
            raise ConfigError(f"--target {name}: expected TTFT_S:ITL_S, got {value!r}")
        try:
            targets[name] = LaneTarget(_number(ttft, f"--target {name}"), _number(itl, f"--target {name}"))
        except ConfigError as exc:
            raise ConfigError(f"--target {name}: {exc}") from None
    return targets


def _tenants(values: list[str]):
    from rtxcore.bench.loadgen import Tenant

    tenants = []
    for name, value in _assignments(values, "--tenant", "NAME=KEY[:WEIGHT]"):
        key, weight = value, 1.0
        # A key may hold colons itself: only a number after the last one is a weight.
        head, sep, tail = value.rpartition(":")
        if sep and head:
            try:
                key, weight = head, float(tail)
            except ValueError:
                pass
        tenants.append(Tenant(name, key, weight))
    return tuple(tenants)


def _assignments(values: list[str], flag: str, form: str, split_commas: bool = False) -> list[tuple[str, str]]:
    """``NAME=VALUE`` items (comma-separated when ``split_commas``) as pairs, refusing a name given twice.

    :param form: how the option is spelled, for the error message.
    """
    items = [part for v in values for part in (v.split(",") if split_commas else [v])]
    pairs: list[tuple[str, str]] = []
    for item in items:
        name, sep, value = item.strip().partition("=")
        if not sep or not name or not value:
            raise ConfigError(f"{flag}: expected {form}, got {item!r}")
        if any(name == seen for seen, _ in pairs):
            raise ConfigError(f"{flag}: {name} is given twice")
        pairs.append((name, value))
    return pairs


def _length_range(value: str, what: str):
    from rtxcore.bench.loadgen import LengthRange

    low, high = _int_pair(value, what)
    try:
        return LengthRange(low, high)
    except ConfigError as exc:
        raise ConfigError(f"{what}: {exc}") from None


def _int_pair(value: str, what: str) -> tuple[int, int]:
    low, sep, high = value.partition(":")
    try:
        if sep:
            return int(low), int(high)
    except ValueError:
        pass
    raise ConfigError(f"{what}: expected LOW:HIGH integers, got {value!r}")


def _number(value: str, what: str) -> float:
    try:
        return float(value)
    except ValueError:
        raise ConfigError(f"{what}: expected a number, got {value!r}") from None
