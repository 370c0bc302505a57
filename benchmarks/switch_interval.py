"""The engine's thread beside a busy serving thread: throughput of many concurrent streams at different values of
``sys.setswitchinterval``.

The engine steps on a thread of its own while the asyncio loop (the serving side) hands out every token. Each torch
call on the engine's thread releases the GIL; when the loop has Python work, it takes the GIL and keeps it until it
blocks or until the engine's thread has waited a whole switch interval (5 ms by default) and asks for it back. A
host-bound step makes dozens of such calls. This measures what that costs: the same streams, each token serialised
as a server would (a JSON chunk), at each interval, in alternating order, several rounds.

    .venv/bin/python benchmarks/switch_interval.py --model dummy:tiny --streams 64 --tokens 128 --rounds 3
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time

from rtxcore.bench.engine import build_engine, serving_engine
from rtxcore.contracts.scheduler import SchedulerConfig
from rtxcore.sampling_params import SamplingParams


async def stream_all(served, num_streams: int, num_tokens: int, prompt_len: int) -> tuple[int, float]:
    params = SamplingParams(max_tokens=num_tokens, temperature=0.0, ignore_eos=True)
    produced = 0

    async def one(i: int) -> None:
        nonlocal produced
        async for out in served.generate([1 + (i + j) % 97 for j in range(prompt_len)], params):
            for token in out.new_token_ids:  # what a server does per token: a JSON chunk
                json.dumps({"id": f"req-{i}", "choices": [{"index": 0, "delta": {"token": token}}]})
                produced += 1

    start = time.perf_counter()
    await asyncio.gather(*(one(i) for i in range(num_streams)))
    return produced, time.perf_counter() - start


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="dummy:tiny")
    p.add_argument("--device", default=None)
    p.add_argument("--streams", type=int, default=64)
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--prompt-tokens", type=int, default=32)
    p.add_argument("--intervals", default="0.005,0.0005", help="comma-separated switch intervals, in seconds")
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    intervals = [float(x) for x in args.intervals.split(",")]
    options: dict = {"model": args.model, "scheduling": SchedulerConfig(max_num_seqs=args.streams)}
    if args.device:
        options["device"] = args.device
    engine = build_engine(**options)
    default = sys.getswitchinterval()
    results: dict[float, list[float]] = {i: [] for i in intervals}
    try:
        warm_up = serving_engine(engine)  # first steps compile and allocate: not part of any figure
        warm_up.start()
        try:
            asyncio.run(stream_all(warm_up, args.streams, 4, args.prompt_tokens))
        finally:
            warm_up.stop()
        for r in range(args.rounds):
            for interval in intervals if r % 2 == 0 else list(reversed(intervals)):
                sys.setswitchinterval(interval)
                served = serving_engine(engine)
                served.start()
                try:
                    produced, seconds = asyncio.run(stream_all(served, args.streams, args.tokens, args.prompt_tokens))
                finally:
                    served.stop()
                results[interval].append(produced / seconds)
                print(f"round {r} interval {interval * 1000:g} ms: {produced} tokens in {seconds:.2f} s = "
                      f"{produced / seconds:.0f} tok/s", flush=True)
    finally:
        sys.setswitchinterval(default)
    base = statistics.median(results[intervals[0]])
    for interval, values in results.items():
        med = statistics.median(values)
        print(json.dumps({"interval_ms": interval * 1000, "tok_s_median": round(med),
                          "tok_s": [round(v) for v in values], "ratio_to_first": round(med / base, 3)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
