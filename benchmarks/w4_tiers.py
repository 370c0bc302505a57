"""W4 (steady multi-turn) with KV tiers: prefix-cache hit rate and latency under load, with a device cache too
small for every conversation (with and without tiers under it) against a device cache with room for everything, all
in one run, repeated over seeds; the p99 ratios to the roomy cache reported as their median and spread.

    .venv/bin/python benchmarks/w4_tiers.py --json w4.json

Per seed: part 1 (capacity and hit rate): ``--rounds`` rounds of ``--conversations`` new conversations run turn
by turn on the roomy cache (every turn of every conversation is the history so far plus new tokens, greedy
replies); its requests per second are the capacity, and its requests the load's. The other configurations run the
first round turn by turn too, for their hit rate (cached prompt tokens over prompt tokens on turns 2..N) and to
check their replies equal the roomy cache's. Part 2 (latency at load): every request of part 1 (fixed token lists)
arrives open-loop, Poisson, at ``--load`` times the capacity, round after round and turn after turn; per
configuration, on the same engine with its prefix cache (lower tiers included) emptied, once every configuration's
part 1 is done, the configurations in an order turned by one each seed (seed order 0: roomy first, 1: the second
configuration first, ...), with Python's garbage collected before each phase: TTFT, inter-token latency
and end-to-end p50/p99, the hit rate at load, and each p99 as a ratio to the roomy cache's in the same seed.

The load part is long enough for a p99 that holds when it has at least ``--load-requests`` requests (default
2,000: a p99 then rests on 20): ``--rounds`` is raised to reach it.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import datetime
import gc
import json
import math
import os
import random
import statistics
import sys
import tempfile
import time

from rtxcore import envs
from rtxcore.bench.engine import Engine, build_engine, generate, serving_engine
from rtxcore.bench.loadgen.stats import percentile
from rtxcore.cli.bench import machine_description
from rtxcore.contracts.scheduler import SchedulerConfig
from rtxcore.kv.tiers.offload_stats import OffloadStats
from rtxcore.sampling_params import SamplingParams

# roomy: a device cache with room for every conversation; offload: a small device cache over a host tier;
# offload-ondemand: the same, each allocation evicting (and spilling) its own blocks (RTX_KV_EVICT_AHEAD=0; the same
# as offload on a CPU); no-offload: the small device cache alone; disk: the small device cache over a small host tier
# over a disk tier.
CONFIGS = ("roomy", "offload", "offload-ondemand", "no-offload", "disk")
RATIO_KEYS = ("ttft_p99_ms", "itl_p99_ms", "e2e_p99_ms")


def make_engine(args, config: str, all_blocks: int, block_bytes: int, disk_dir: str) -> Engine:
    roomy = config == "roomy"
    blocks = int((args.roomy_factor if roomy else args.device_factor) * all_blocks) + 1
    host_factor = {"offload": args.host_factor, "offload-ondemand": args.host_factor,
                   "disk": args.disk_host_factor}.get(config, 0.0)
    disk = {"kv_disk_dir": disk_dir, "kv_disk_bytes": int(args.host_factor * all_blocks) * block_bytes,
            "kv_snapshot_interval_s": 0} if config == "disk" else {}
    ahead = os.environ.get(envs.RTX_KV_EVICT_AHEAD.name)
    if config == "offload-ondemand":
        os.environ[envs.RTX_KV_EVICT_AHEAD.name] = "0"  # read when the engine makes its KV cache
    try:
        return build_engine(model=args.model, num_kv_blocks=blocks,
                            kv_host_bytes=int(host_factor * all_blocks) * block_bytes, **disk,
                            max_model_len=args.max_model_len,
                            scheduling=SchedulerConfig(max_num_seqs=args.max_num_seqs,
                                                       max_num_batched_tokens=args.max_num_batched_tokens))
    finally:
        if config == "offload-ondemand":
            if ahead is None:
                del os.environ[envs.RTX_KV_EVICT_AHEAD.name]
            else:
                os.environ[envs.RTX_KV_EVICT_AHEAD.name] = ahead


def conversations(args, engine: Engine, seed: int, rounds: int) -> tuple[list[list[int]], float, float]:
    """Run ``rounds`` rounds of new conversations, each turn by turn; returns every request's prompt (rounds in
    order, turns in order within a round; prompts hold the replies of the turns before: greedy, so equal prompts
    across configurations mean equal outputs), the hit rate over turns 2..N and the seconds taken."""
    rng = random.Random(seed)
    vocab = engine.core.model_config.vocab_size
    params = SamplingParams(max_tokens=args.reply_tokens, temperature=0.0, ignore_eos=True)
    generate(engine, [[rng.randrange(3, vocab) for _ in range(8)]], params)  # warm-up, untimed
    requests, prompt_tokens, cached_tokens = [], 0, 0
    start = time.perf_counter()
    for _ in range(rounds):
        history: list[list[int]] = [[] for _ in range(args.conversations)]
        for turn in range(args.turns):
            prompts = [h + [rng.randrange(3, vocab) for _ in range(args.new_tokens)] for h in history]
            requests.extend(prompts)
            results = generate(engine, prompts, params)
            if turn > 0:
                prompt_tokens += sum(len(p) for p in prompts)
                cached_tokens += sum(r.num_cached_tokens for r in results)
            history = [p + r.token_ids for p, r in zip(prompts, results)]
    return requests, cached_tokens / max(prompt_tokens, 1), time.perf_counter() - start


def copy_counts(after: OffloadStats | None, before: OffloadStats | None) -> dict[str, float]:
    """The tiers' copies in a load phase: steps that waited for a reload and how long, blocks copied down at
    eviction (spilled), evictions that found their block below already (spill hits), blocks written back ahead,
    blocks read from disk ahead of their reload (prefetched)."""
    if after is None or before is None:
        return {"copy_wait_steps": 0, "copy_wait_ms": 0}
    return {"copy_wait_steps": after.num_copy_wait_steps - before.num_copy_wait_steps,
            "copy_wait_ms": round(1000 * (after.copy_wait_seconds - before.copy_wait_seconds), 1),
            "spilled_blocks": after.num_spilled - before.num_spilled,
            "copy_down_host_s": round(after.copy_down_host_seconds - before.copy_down_host_seconds, 3),
            "reload_host_s": round(after.reload_host_seconds - before.reload_host_seconds, 3),
            "spill_hits": after.num_spill_hits - before.num_spill_hits,
            "written_back_blocks": after.num_written_back - before.num_written_back,
            "prefetched_blocks": after.num_prefetched - before.num_prefetched}


async def under_load(args, engine: Engine, requests: list[list[int]], rate: float, seed: int) -> dict[str, float]:
    """Open-loop Poisson arrivals of ``requests`` in order; per-request latencies."""
    before = engine.core.kv_cache.stats
    tiers = engine.core.kv_tiers
    copies_before = dataclasses.replace(tiers.offload.stats) if tiers else None
    disk = tiers.disk if tiers else None
    host = tiers.host if tiers else None
    # Blocks the disk tier skipped (its writes behind) and stored, and those the host tier lent it but copied itself.
    disk_before = (disk.stats.num_skipped_busy, disk.stats.num_stored,
                   host.stats.num_lent_copies if host else 0) if disk else (0, 0, 0)
    ahead = engine.core.kv_cache.evict_ahead
    ahead_before = (ahead.num_evicted, ahead.num_batches) if ahead is not None else None
    served = serving_engine(engine)
    served.start()
    params = SamplingParams(max_tokens=args.reply_tokens, temperature=0.0, ignore_eos=True)
    rng = random.Random(seed + 1)
    ttft, itl, e2e = [], [], []
    preemptions = 0

    async def one(prompt: list[int]) -> None:
        nonlocal preemptions
        sent = last = time.perf_counter()
        first = True
        async for out in served.generate(prompt, params):
            now = time.perf_counter()
            if out.new_token_ids:
                (ttft if first else itl).append(now - (sent if first else last))
                first, last = False, now
            if out.finished and out.timings is not None:
                preemptions += out.timings.num_preemptions
        e2e.append(time.perf_counter() - sent)

    tasks = []
    await collect_warm_up(served, params)
    start = time.perf_counter()
    for prompt in requests:
        tasks.append(asyncio.create_task(one(prompt)))
        await asyncio.sleep(rng.expovariate(rate))
    await asyncio.gather(*tasks)
    elapsed = time.perf_counter() - start
    served.stop()
    stats = engine.core.kv_cache.stats
    copies = engine.core.kv_tiers.offload.stats if engine.core.kv_tiers is not None else None
    queried = stats.num_prefix_query_tokens - before.num_prefix_query_tokens
    hit = stats.num_prefix_hit_tokens - before.num_prefix_hit_tokens
    return {"requests": len(tasks), "seconds": round(elapsed, 2), "hit_rate": round(hit / max(queried, 1), 4),
            "reloaded_tokens": stats.num_reloaded_tokens - before.num_reloaded_tokens, "preemptions": preemptions,
            **copy_counts(copies, copies_before),
            **({"disk_skipped_blocks": disk.stats.num_skipped_busy - disk_before[0],
                "disk_stored_blocks": disk.stats.num_stored - disk_before[1],
                "host_lent_copies": (host.stats.num_lent_copies if host else 0) - disk_before[2]} if disk else {}),
            **({"evicted_ahead_blocks": ahead.num_evicted - ahead_before[0],
                "evict_ahead_batches": ahead.num_batches - ahead_before[1]}
               if ahead is not None and ahead_before is not None else {}),
            # ITL to 0.01 ms: its p99 is a few milliseconds on a GPU, where 0.1 ms moves the ratio by 2-3%.
            **{f"{name}_{q}_ms": round(1000 * percentile(values, p), 2 if name == "itl" else 1)
               for name, values in (("ttft", ttft), ("itl", itl), ("e2e", e2e))
               for q, p in (("p50", 50), ("p99", 99))}}


async def collect_warm_up(served, params: SamplingParams) -> None:
    async for _ in served.generate([7] * 8, params):
        pass


def profiled(args, config: str, engine: Engine, load) -> dict[str, float]:
    """The ``load`` coroutine run with the engine's steps under cProfile (they run on the engine's thread): where the
    host's time went, waiting for the device included, printed (and saved beside ``--json``) as the top functions by
    own time and by cumulative time. The profiler inflates the figures; compare configurations profiled alike."""
    import cProfile
    import io
    import pstats

    profiler = cProfile.Profile()
    core = engine.core  # what the serving front steps
    step = core.step

    def profiled_step(*a, **kw):
        profiler.enable()
        try:
            return step(*a, **kw)
        finally:
            profiler.disable()

    core.step = profiled_step  # type: ignore[method-assign]
    try:
        result = asyncio.run(load)
    finally:
        del core.step
    out = io.StringIO()
    stats = pstats.Stats(profiler, stream=out)
    stats.sort_stats("tottime").print_stats(30)
    stats.sort_stats("cumulative").print_stats(40)
    text = f"== profile of the load part, {config}\n{out.getvalue()}"
    print(text, flush=True)
    if args.json:
        with open(f"{args.json.removesuffix('.json')}_profile_{config}.txt", "w") as fh:
            fh.write(text)
        # The raw statistics too, for callers and callees (pstats.Stats(path).print_callees(...)).
        stats.dump_stats(f"{args.json.removesuffix('.json')}_profile_{config}.pstats")
    return result


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="as rtx --model (default: smollm2-135m)")
    p.add_argument("--conversations", type=int, default=8)
    p.add_argument("--turns", type=int, default=8)
    p.add_argument("--new-tokens", type=int, default=32, help="new tokens per turn (W4: ~64)")
    p.add_argument("--reply-tokens", type=int, default=48)
    p.add_argument("--max-num-seqs", type=int, default=4)
    p.add_argument("--max-num-batched-tokens", type=int, default=512)
    p.add_argument("--device-factor", type=float, default=1 / 1.5,
                   help="device KV blocks as a share of what every conversation's history needs (default: 1/1.5, "
                        "a working set of 1.5x the device tier)")
    p.add_argument("--roomy-factor", type=float, default=1.5)
    p.add_argument("--host-factor", type=float, default=1.5,
                   help="host tier (offload), and disk tier (disk), as a share of the same")
    p.add_argument("--disk-host-factor", type=float, default=0.25, help="the host tier above the disk tier (disk)")
    p.add_argument("--load", type=float, default=1.5, help="arrival rate as a multiple of the measured capacity")
    p.add_argument("--load-requests", type=int, default=2000,
                   help="fewest requests in the load part (rounds of new conversations are added to reach it)")
    p.add_argument("--seeds", default="0,1,2", help="comma-separated seeds: one repetition each")
    p.add_argument("--configs", default=",".join(CONFIGS), help=f"comma-separated, among {', '.join(CONFIGS)} "
                   "(roomy always runs: it sets the load and the ratios' base)")
    p.add_argument("--json", default=None, help="also write the results here")
    p.add_argument("--profile", default="", help="comma-separated configurations whose load part runs with the "
                   f"engine's steps under cProfile (of {', '.join(CONFIGS)}); their latencies are then not comparable")
    args = p.parse_args()
    args.profile = [c for c in args.profile.split(",") if c]
    configs = ["roomy"] + [c for c in args.configs.split(",") if c and c != "roomy"]
    if set(args.profile) - set(CONFIGS) or set(configs) - set(CONFIGS):
        p.error(f"--configs and --profile take configurations among {', '.join(CONFIGS)}")
    seeds = [int(s) for s in args.seeds.split(",")]
    longest = args.turns * (args.new_tokens + args.reply_tokens)
    args.max_model_len = longest + 16
    all_blocks = args.conversations * -(-longest // 16)
    rounds = max(1, math.ceil(args.load_requests / (args.conversations * args.turns)))

    report = {"command": " ".join(sys.argv), "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
              "machine": machine_description(), "args": vars(args), "rounds": rounds, "seeds": {}}
    disk_dir = tempfile.mkdtemp(prefix="w4-disk-tier-")
    # One engine per configuration for every seed (building one can take a while on a GPU: CUDA graphs); its
    # prefix cache, lower tiers included, is emptied between parts. roomy's is built first: it gives block_bytes.
    engines: dict[str, Engine] = {}
    warmed = False
    for seed in seeds:
        run = report["seeds"][seed] = {"hit_rate": {}, "load": {}}
        requests: list[list[int]] = []
        capacity = 0.0
        for config in configs:
            if config not in engines:
                roomy = engines.get("roomy")
                block_bytes = (roomy.core.backend.kv_cache_bytes_per_token() * roomy.core.config.block_size
                               if roomy else 0)
                engines[config] = make_engine(args, config, all_blocks, block_bytes, disk_dir)
            engine = engines[config]
            engine.core.kv_cache.reset_prefix_cache()
            prompts, rate, seconds = conversations(args, engine, seed, rounds if config == "roomy" else 1)
            same = config == "roomy" or prompts == requests[:len(prompts)]
            run["hit_rate"][config] = {"hit_rate_turns_2_on": round(rate, 4), "seconds": round(seconds, 2),
                                       "device_blocks": engine.core.kv_cache.num_usable_blocks,
                                       "same_replies_as_roomy": same}
            print(f"seed {seed} hit rate {config:>10}: {rate:.3f} over turns 2..{args.turns} ({seconds:.1f}s, "
                  f"{engine.core.kv_cache.num_usable_blocks} device blocks, same replies as roomy: {same})",
                  flush=True)
            if config == "roomy":
                requests = prompts
                capacity = len(requests) / seconds
                run["capacity_requests_per_s"] = round(capacity, 3)
                run["arrival_rate_per_s"] = round(args.load * capacity, 3)
        # Part 2 after every configuration's part 1, in an order turned by one configuration each seed: the phase run
        # first in a seed (right after the long roomy part 1) is not always the same configuration's.
        turn = seeds.index(seed) % len(configs)
        for config in configs[turn:] + configs[:turn]:
            engine = engines[config]
            engine.core.kv_cache.reset_prefix_cache()
            if seed == seeds[0] and not warmed:
                # Once untimed (one round): the load's batch shapes differ from part 1's, and compiling kernels for
                # them (Triton on a GPU) must not land in the first configuration's figures.
                asyncio.run(under_load(args, engine, requests[:args.conversations * args.turns],
                                       args.load * capacity, seed))
                engine.core.kv_cache.reset_prefix_cache()
                warmed = True
            gc.collect()  # the garbage of part 1 and of the phase before is not collected inside this phase
            load = under_load(args, engine, requests, args.load * capacity, seed)
            result = profiled(args, config, engine, load) if config in args.profile else asyncio.run(load)
            run["load"][config] = result
            print(f"seed {seed} at {args.load}x load {config:>10}: " + ", ".join(f"{k}={v}" for k, v in result.items()),
                  flush=True)
        base = run["load"]["roomy"]
        for config in configs[1:]:
            result = run["load"][config]
            result.update({f"{k}_ratio": round(result[k] / base[k], 3) for k in RATIO_KEYS if base[k]})
            result["hit_rate_minus_roomy"] = round(result["hit_rate"] - base["hit_rate"], 4)
        if args.json:  # after every seed: a run cut short keeps what it measured
            with open(args.json, "w") as fh:
                json.dump(report, fh, indent=2)
    report["summary"] = summary(report, configs[1:])
    for config, figures in report["summary"].items():
        print(f"{config} / roomy over seeds {args.seeds}: " + ", ".join(
            f"{k} median {v['median']} ({v['min']}-{v['max']})" for k, v in figures.items()))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(report, fh, indent=2)
    return 0


def summary(report: dict, configs: list[str]) -> dict[str, dict[str, dict[str, float]]]:
    """Per configuration, each p99 ratio and the hit-rate difference at load: median, least and most over seeds."""
    out: dict[str, dict[str, dict[str, float]]] = {}
    for config in configs:
        out[config] = {}
        for key in [f"{k}_ratio" for k in RATIO_KEYS] + ["hit_rate_minus_roomy"]:
            values = [run["load"][config][key] for run in report["seeds"].values() if key in run["load"][config]]
            if values:
                out[config][key] = {"median": round(statistics.median(values), 3), "min": min(values),
                                    "max": max(values)}
    return out


if __name__ == "__main__":
    sys.exit(main())
