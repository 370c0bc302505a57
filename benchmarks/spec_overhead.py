"""The cost of a verification step against a plain decode step, for k = 1..8 proposed tokens, one stream.

A random-weight target and draft (``dummy:llama-8b`` with a ``dummy:llama-1b``-shaped draft) accept nothing, so each
step emits one token whatever k is: the time per token is what a step with k proposals costs. Reported per k: ms per
step, the share of it spent drafting, and the ratio to a plain decode step of the same target in the same run (an
engine without a proposer, overlapped steps and CUDA graphs as in production).

    python benchmarks/spec_overhead.py [--model dummy:llama-8b] [--draft-model dummy:llama-1b] [--json F]
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time

import torch

from rtxcore.bench.engine import build_engine
from rtxcore.cli.bench import machine_description
from rtxcore.engine.config import EngineConfig
from rtxcore.engine.speculation.config import SpeculativeConfig
from rtxcore.sampling_params import SamplingParams


def _sync(engine) -> None:
    if engine.core.backend.device.type == "cuda":
        torch.cuda.synchronize()


def ms_per_token(engine, prompt: list[int], num_tokens: int) -> float:
    params = SamplingParams(max_tokens=num_tokens, temperature=0.0, ignore_eos=True)
    engine.add_request(prompt, params)
    while engine.core.has_unfinished_requests():  # the prefill and first token are not timed
        outs = engine.core.step()
        if any(out.new_token_ids for out in outs):
            break
    _sync(engine)
    start, produced = time.perf_counter(), 0
    while engine.core.has_unfinished_requests():
        produced += sum(len(out.new_token_ids) for out in engine.core.step())
    _sync(engine)
    engine.core.kv_cache.reset_prefix_cache()
    return 1000 * (time.perf_counter() - start) / max(produced, 1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="dummy:llama-8b")
    ap.add_argument("--draft-model", default="dummy:llama-1b")
    ap.add_argument("--max-k", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--kv-cache-bytes", type=float, default=8e9, help="each engine's KV cache (two engines share "
                                                                       "the device)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    prompt = [random.Random(0).randint(100, 20000) for _ in range(128)]
    common = dict(model=args.model, kv_cache_bytes=int(args.kv_cache_bytes), max_model_len=4096)
    plain = build_engine(EngineConfig(**common))
    ms_per_token(plain, prompt, 16)  # warm-up
    plain_ms = ms_per_token(plain, prompt, args.tokens)
    del plain
    torch.cuda.empty_cache() if torch.cuda.is_available() else None
    spec = SpeculativeConfig(method="draft", options={"draft_model": args.draft_model}, num_speculative_tokens=16,
                             adaptive=False, min_acceptance=0.0)
    engine = build_engine(EngineConfig(**common, speculative=spec))
    speculator = engine.core.speculator
    proposer = speculator.proposers["draft"]
    drafting = [0.0]
    propose = proposer.propose

    def timed_propose(reqs, num_tokens):
        _sync(engine)
        start = time.perf_counter()
        out = propose(reqs, num_tokens)
        _sync(engine)
        drafting[0] += time.perf_counter() - start
        return out

    proposer.propose = timed_propose  # type: ignore[method-assign]
    rows = []
    for k in range(1, args.max_k + 1):
        speculator.tracker.max_k = k
        ms_per_token(engine, prompt, 16)  # warm-up: this k's shapes
        drafting[0] = 0.0
        stats = speculator.stats["draft"]
        steps_before = stats.num_verifications
        ms = ms_per_token(engine, prompt, args.tokens)
        steps = stats.num_verifications - steps_before
        rows.append({"k": k, "ms_per_step": ms, "vs_plain_decode": ms / plain_ms,
                     "draft_ms_per_step": 1000 * drafting[0] / max(steps, 1),
                     "acceptance_rate": stats.acceptance_rate})
    print(f"# python benchmarks/spec_overhead.py {' '.join(sys.argv[1:])}")
    print(f"# {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())} on {machine_description()}")
    print(f"plain decode step ({args.model}): {plain_ms:.3f} ms")
    print(f"{'k':>2} {'ms/step':>8} {'vs plain':>9} {'drafting ms':>12} {'verify+rest ms':>15}")
    for r in rows:
        print(f"{r['k']:2d} {r['ms_per_step']:8.3f} {r['vs_plain_decode']:8.2f}x {r['draft_ms_per_step']:12.3f} "
              f"{r['ms_per_step'] - r['draft_ms_per_step']:15.3f}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"machine": machine_description(), "plain_ms": plain_ms, "rows": rows}, fh, indent=2)


if __name__ == "__main__":
    main()
