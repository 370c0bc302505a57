"""fp8 against bf16 (and fp32) on the default model's real weights, as the engine runs them: perplexity of the quality
gate's held-out text (the first 512 tokens of the evaluation half of CPython's pydoc topics), each precision scored by
an engine's own backend (fp8: weights quantized at load, per-token activation scales, fp8 GEMMs on a GPU that has
them); then an fp8 KV cache (``--kv-cache-dtype fp8``) under the bf16 and fp32 models. Fails (exit 1) when fp8
weights raise perplexity over bf16 by more than spec/gates.toml's budget for fp8 with every layer quantized
(``[quality.quantizer_max_ppl_increase]``; the seed's 0.5 holds for fp8 through the planner, which `rtx gates`
checks), or an fp8 KV cache raises it past ``FP8_KV_CACHE_MAX_PPL_RATIO`` times the model's own cache's.

Usage: python benchmarks/fp8_quality.py --model MODEL.gguf [--device cuda] [--json OUT.json]   (benchmarks/gpu.py real)
"""

from __future__ import annotations

import argparse
import json
import sys

from rtx_conformance.gates.config import load_gates
from rtxcore.bench.engine import build_engine
from rtxcore.quant.evaluation import FP8_KV_CACHE_MAX_PPL_RATIO, backend_perplexity
from rtxcore.quant.pipeline import evaluation_tokens
from rtxcore.transfer import release_device_memory

EVAL_TOKENS = 512
CHUNK = 512


def score(model: str, device: str, dtype: str, quantization: str | None, kv_cache_dtype: str = "auto") -> float:
    engine = build_engine(model=model, device=device, dtype=dtype, quantization=quantization, enforce_eager=True,
                          max_model_len=CHUNK + 16, kv_cache_dtype=kv_cache_dtype)
    tokens = evaluation_tokens(engine.core.source, EVAL_TOKENS)
    ppl = backend_perplexity(engine.core.backend, tokens, CHUNK)
    del engine
    release_device_memory()
    return ppl


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--device", default="cuda")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    ppl = {"float32": score(args.model, args.device, "float32", None),
           "bfloat16": score(args.model, args.device, "bfloat16", None),
           "fp8": score(args.model, args.device, "bfloat16", "fp8"),
           "bfloat16, fp8 KV cache": score(args.model, args.device, "bfloat16", None, "fp8"),
           "float32, fp8 KV cache": score(args.model, args.device, "float32", None, "fp8")}
    budget = load_gates(None).quality.quantizer_max_ppl_increase["fp8"]
    increase = ppl["fp8"] - ppl["bfloat16"]
    kv_ratios = {dtype: ppl[f"{dtype}, fp8 KV cache"] / ppl[dtype] for dtype in ("bfloat16", "float32")}
    within = increase <= budget and max(kv_ratios.values()) <= FP8_KV_CACHE_MAX_PPL_RATIO
    print(f"perplexity on {EVAL_TOKENS} held-out tokens ({args.device}): fp32 {ppl['float32']:.3f}, bf16 "
          f"{ppl['bfloat16']:.3f}, fp8 {ppl['fp8']:.3f}: fp8 - bf16 = {increase:+.3f} (budget +{budget})", flush=True)
    for dtype, ratio in kv_ratios.items():
        print(f"{dtype} with an fp8 KV cache: {ppl[f'{dtype}, fp8 KV cache']:.3f}, x{ratio:.4f} of its own cache's "
              f"(budget x{FP8_KV_CACHE_MAX_PPL_RATIO})", flush=True)
    print("within budgets" if within else "OVER a budget", flush=True)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"device": args.device, "tokens": EVAL_TOKENS, "perplexity": ppl,
                       "fp8_minus_bf16": increase, "budget": budget, "fp8_kv_cache_ratios": kv_ratios,
                       "fp8_kv_cache_budget": FP8_KV_CACHE_MAX_PPL_RATIO, "within_budget": within}, fh, indent=2)
    return 0 if within else 1


if __name__ == "__main__":
    sys.exit(main())
