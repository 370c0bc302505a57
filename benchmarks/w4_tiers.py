"""W4 (steady multi-turn) scaled to this CPU, with KV tiers: prefix-cache hit rate and latency under load, with a
device cache too small for every conversation, against the same device cache without offload and against a device
cache with room for everything, all in one run.

    .venv/bin/python benchmarks/w4_tiers.py --json w4.json

Part 1, hit rate: the conversations run turn by turn (every turn of every conversation is the history so far plus
new tokens), once per configuration; the hit rate is cached prompt tokens over prompt tokens on turns 2..N.
Part 2, latency at load: the requests part 1 made (fixed token lists, greedy replies) arrive open-loop, Poisson, at
``--load`` times the capacity measured in part 1 with the roomy cache, turn after turn; per configuration, on the
same engine with its prefix cache emptied, TTFT, inter-token latency and end-to-end p50/p99, and each p99 as a
ratio to the roomy cache's.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import random
import sys
import time

from rtxcore.bench.engine import Engine, build_engine, generate, serving_engine
from rtxcore.bench.loadgen.stats import percentile
from rtxcore.cli.bench import machine_description
from rtxcore.contracts.scheduler import SchedulerConfig
from rtxcore.sampling_params import SamplingParams

CONFIGS = ("roomy", "offload", "no-offload")


def make_engine(args, config: str, all_blocks: int, block_bytes: int) -> Engine:
    roomy = config == "roomy"
    blocks = int((args.roomy_factor if roomy else args.device_factor) * all_blocks) + 1
    host_bytes = int(args.host_factor * all_blocks) * block_bytes if config == "offload" else 0
    return build_engine(model=args.model, num_kv_blocks=blocks, kv_host_bytes=host_bytes,
                        max_model_len=args.max_model_len,
                        scheduling=SchedulerConfig(max_num_seqs=args.max_num_seqs,
                                                   max_num_batched_tokens=args.max_num_batched_tokens))


def turns(args, engine: Engine) -> tuple[list[list[list[int]]], float, float]:
    """Run every turn; returns each turn's prompts (which hold the replies of the turns before: greedy, so equal
    prompts across configurations mean equal outputs), the hit rate over turns 2..N and the seconds taken."""
    rng = random.Random(args.seed)
    vocab = engine.core.model_config.vocab_size
    params = SamplingParams(max_tokens=args.reply_tokens, temperature=0.0, ignore_eos=True)
    history: list[list[int]] = [[] for _ in range(args.conversations)]
    prompts_by_turn, prompt_tokens, cached_tokens = [], 0, 0
    generate(engine, [[rng.randrange(3, vocab) for _ in range(8)]], params)  # warm-up, untimed
    start = time.perf_counter()
    for turn in range(args.turns):
        prompts = [h + [rng.randrange(3, vocab) for _ in range(args.new_tokens)] for h in history]
        prompts_by_turn.append(prompts)
        results = generate(engine, prompts, params)
        if turn > 0:
            prompt_tokens += sum(len(p) for p in prompts)
            cached_tokens += sum(r.num_cached_tokens for r in results)
        history = [p + r.token_ids for p, r in zip(prompts, results)]
    return prompts_by_turn, cached_tokens / max(prompt_tokens, 1), time.perf_counter() - start


async def under_load(args, engine: Engine, prompts_by_turn, rate: float) -> dict[str, float]:
    """Open-loop Poisson arrivals of every turn's requests in turn order; per-request latencies."""
    before = engine.core.kv_cache.stats
    served = serving_engine(engine)
    served.start()
    params = SamplingParams(max_tokens=args.reply_tokens, temperature=0.0, ignore_eos=True)
    rng = random.Random(args.seed + 1)
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
    start = time.perf_counter()
    await collect_warm_up(served, params)
    for prompts in prompts_by_turn:
        for prompt in prompts:
            tasks.append(asyncio.create_task(one(prompt)))
            await asyncio.sleep(rng.expovariate(rate))
    await asyncio.gather(*tasks)
    elapsed = time.perf_counter() - start
    served.stop()
    stats = engine.core.kv_cache.stats
    queried = stats.num_prefix_query_tokens - before.num_prefix_query_tokens
    hit = stats.num_prefix_hit_tokens - before.num_prefix_hit_tokens
    return {"requests": len(tasks), "seconds": round(elapsed, 2), "hit_rate": round(hit / max(queried, 1), 4),
            "reloaded_tokens": stats.num_reloaded_tokens - before.num_reloaded_tokens, "preemptions": preemptions,
            **{f"{name}_{q}_ms": round(1000 * percentile(values, p), 1)
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
    step = engine.step

    def profiled_step(*a, **kw):
        profiler.enable()
        try:
            return step(*a, **kw)
        finally:
            profiler.disable()

    engine.step = profiled_step
    try:
        result = asyncio.run(load)
    finally:
        del engine.step
    out = io.StringIO()
    stats = pstats.Stats(profiler, stream=out)
    stats.sort_stats("tottime").print_stats(30)
    stats.sort_stats("cumulative").print_stats(40)
    text = f"== profile of the load part, {config}\n{out.getvalue()}"
    print(text, flush=True)
    if args.json:
        with open(f"{args.json.removesuffix('.json')}_profile_{config}.txt", "w") as fh:
            fh.write(text)
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
    p.add_argument("--host-factor", type=float, default=1.5, help="host tier, as a share of the same")
    p.add_argument("--load", type=float, default=1.5, help="arrival rate as a multiple of the measured capacity")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="also write the results here")
    p.add_argument("--profile", default="", help="comma-separated configurations whose load part runs with the "
                   f"engine's steps under cProfile (of {', '.join(CONFIGS)}); their latencies are then not comparable")
    args = p.parse_args()
    args.profile = [c for c in args.profile.split(",") if c]
    if set(args.profile) - set(CONFIGS):
        p.error(f"--profile takes configurations among {', '.join(CONFIGS)}")
    longest = args.turns * (args.new_tokens + args.reply_tokens)
    args.max_model_len = longest + 16
    all_blocks = args.conversations * -(-longest // 16)

    report = {"command": " ".join(sys.argv), "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
              "machine": machine_description(), "args": vars(args), "hit_rate": {}, "load": {}}
    prompts_by_turn, capacity, block_bytes = None, None, 0
    # One engine per configuration for both parts (building one can take a while on a GPU: CUDA graphs); its
    # prefix cache, lower tiers included, is emptied between them.
    for config in CONFIGS:
        engine = make_engine(args, config, all_blocks, block_bytes)
        prompts, rate, seconds = turns(args, engine)
        report["hit_rate"][config] = {"hit_rate_turns_2_on": round(rate, 4), "seconds": round(seconds, 2),
                                      "device_blocks": engine.core.kv_cache.num_usable_blocks,
                                      "same_replies_as_roomy": prompts_by_turn is None or prompts == prompts_by_turn}
        print(f"hit rate {config:>10}: {rate:.3f} over turns 2..{args.turns} ({seconds:.1f}s, "
              f"{engine.core.kv_cache.num_usable_blocks} device blocks, same replies as roomy: "
              f"{report['hit_rate'][config]['same_replies_as_roomy']})", flush=True)
        if config == "roomy":
            prompts_by_turn = prompts
            capacity = args.conversations * args.turns / seconds
            block_bytes = engine.core.backend.kv_cache_bytes_per_token() * engine.core.config.block_size
            report["capacity_requests_per_s"] = round(capacity, 3)
            report["arrival_rate_per_s"] = round(args.load * capacity, 3)
        engine.core.kv_cache.reset_prefix_cache()
        if config == "roomy":
            # Once untimed: the load's batch shapes differ from part 1's, and compiling kernels for them (Triton on
            # a GPU) must not land in the first configuration's figures.
            asyncio.run(under_load(args, engine, prompts_by_turn, args.load * capacity))
            engine.core.kv_cache.reset_prefix_cache()
        load = under_load(args, engine, prompts_by_turn, args.load * capacity)
        result = profiled(args, config, engine, load) if config in args.profile else asyncio.run(load)
        report["load"][config] = result
        print(f"at {args.load}x load {config:>10}: " + ", ".join(f"{k}={v}" for k, v in result.items()), flush=True)
    base = report["load"]["roomy"]
    for config in CONFIGS[1:]:
        ratios = {f"{k}_ratio": round(report["load"][config][k] / base[k], 3)
                  for k in ("ttft_p99_ms", "itl_p99_ms", "e2e_p99_ms") if base[k]}
        report["load"][config].update(ratios)
        print(f"p99 {config} / roomy: {ratios}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(report, fh, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
