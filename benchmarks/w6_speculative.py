"""W6 (input-grounded work, speculative decoding): tokens/s of each proposer against plain decoding in the same run,
with the acceptance rate and mean accepted length, greedy and sampled, one request and a batch of eight.

    python benchmarks/w6_speculative.py [--model M] [--methods ngram layer-skip] [--draft-model D] [--json F]
"""

from __future__ import annotations

import argparse
import gc
import json
import time

import torch

from rtxcore.bench.engine import build_engine
from rtxcore.bench.workloads import make_requests
from rtxcore.cli.bench import machine_description
from rtxcore.engine.config import EngineConfig
from rtxcore.engine.speculation.config import SpeculativeConfig
from rtxcore.sampling_params import SamplingParams


def run(engine, requests, temperature: float) -> tuple[float, int, float, list[list[int]]]:
    """Seconds, output tokens, seconds to the first token of the first request, and each request's tokens."""
    params = [SamplingParams(max_tokens=r.output_len, temperature=temperature, ignore_eos=True, seed=i)
              for i, r in enumerate(requests)]
    ids = [engine.add_request(r.prompt_token_ids, p) for r, p in zip(requests, params)]
    start = time.perf_counter()
    produced, first = 0, None
    tokens: dict[str, list[int]] = {i: [] for i in ids}
    while engine.core.has_unfinished_requests():
        for out in engine.core.step():
            produced += len(out.new_token_ids)
            tokens[out.req_id] += out.new_token_ids
            if first is None and out.new_token_ids and out.req_id == ids[0]:
                first = time.perf_counter() - start
    if engine.core.backend.device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start, produced, first or 0.0, [tokens[i] for i in ids]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="target model (default: the default model)")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--methods", nargs="+", default=["ngram", "layer-skip"])
    ap.add_argument("--draft-model", default=None, help="also run the draft proposer with this model")
    ap.add_argument("--num-speculative-tokens", type=int, default=4)
    ap.add_argument("--workloads", nargs="+", default=["W6", "W6x8"])
    ap.add_argument("--temperatures", nargs="+", type=float, default=[0.0, 0.7])
    ap.add_argument("--option", action="append", default=[], help="proposer option KEY=VALUE (e.g. layers=0-15)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    options = dict(o.split("=", 1) for o in args.option)
    methods: list[str | None] = [None, *args.methods] + (["draft"] if args.draft_model else [])
    rows = []
    plain_outputs: dict[tuple[str, float], list[list[int]]] = {}
    for method in methods:
        opts = {"draft_model": args.draft_model} if method == "draft" else dict(options) if method else {}
        spec = SpeculativeConfig(method=method, options=opts, num_speculative_tokens=args.num_speculative_tokens)
        engine = build_engine(EngineConfig(model=args.model, dtype=args.dtype, speculative=spec))
        tokenizer = engine.core.tokenizer
        for workload in args.workloads:
            requests = make_requests(workload, engine.core.model_config.vocab_size, tokenizer=tokenizer)
            for temperature in args.temperatures:
                # Warm-up: on an accelerator the workload itself, so kernels are compiled for its shapes.
                run(engine, requests if engine.core.backend.device.type != "cpu" else requests[:1], temperature)
                engine.core.kv_cache.reset_prefix_cache()
                before = {k: (s.num_proposed_tokens, s.num_accepted_tokens, s.num_verifications)
                          for k, s in engine.core.speculator.stats.items()}
                seconds, tokens, ttft, outputs = run(engine, requests, temperature)
                if method is None:
                    plain_outputs[(workload, temperature)] = outputs
                engine.core.kv_cache.reset_prefix_cache()
                proposed = accepted = verifications = 0
                if method:
                    p0, a0, v0 = before[method]
                    s = engine.core.speculator.stats[method]
                    proposed, accepted = s.num_proposed_tokens - p0, s.num_accepted_tokens - a0
                    verifications = s.num_verifications - v0
                rows.append({"method": method or "plain", "workload": workload, "temperature": temperature,
                             "tokens_per_s": tokens / seconds, "seconds": seconds, "tokens": tokens,
                             "acceptance_rate": accepted / proposed if proposed else None,
                             "mean_accepted_length": 1 + accepted / verifications if verifications else None,
                             # Greedy output must not change (numerics permitting: a verification computes several
                             # positions at once, a plain step one).
                             "same_as_plain": outputs == plain_outputs[(workload, temperature)]
                             if temperature == 0 else None})
                print(f"{method or 'plain':11} {workload:5} T={temperature:.1f} {tokens / seconds:9.1f} tok/s",
                      flush=True)
        del engine
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    plain = {(r["workload"], r["temperature"]): r["tokens_per_s"] for r in rows if r["method"] == "plain"}
    for r in rows:
        r["vs_plain"] = r["tokens_per_s"] / plain[(r["workload"], r["temperature"])]
    print(f"# python benchmarks/w6_speculative.py {' '.join(__import__('sys').argv[1:])}")
    print(f"# {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())} on {machine_description()}")
    print(f"{'method':11} {'workload':8} {'temp':>4} {'tok/s':>9} {'vs plain':>8} {'accept':>7} {'mean run':>8} "
          f"{'greedy same':>11}")
    for r in rows:
        rate = f"{r['acceptance_rate']:.0%}" if r["acceptance_rate"] is not None else "-"
        run_len = f"{r['mean_accepted_length']:.2f}" if r["mean_accepted_length"] is not None else "-"
        same = {None: "-", True: "yes", False: "NO"}[r["same_as_plain"]]
        print(f"{r['method']:11} {r['workload']:8} {r['temperature']:4.1f} {r['tokens_per_s']:9.1f} "
              f"{r['vs_plain']:7.2f}x {rate:>7} {run_len:>8} {same:>11}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"machine": machine_description(), "rows": rows}, fh, indent=2)


if __name__ == "__main__":
    main()
