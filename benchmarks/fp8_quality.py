"""fp8 against bf16 (and fp32) on the default model's real weights, as the engine runs them: perplexity of the quality
gate's held-out text (the first 512 tokens of the evaluation half of CPython's pydoc topics), each precision scored by
an engine's own backend (fp8: weights quantized at load, per-token activation scales, fp8 GEMMs on a GPU that has
them). Fails (exit 1) when fp8 raises perplexity over bf16 by more than spec/gates.toml's budget for fp8 with every
layer quantized (``[quality.quantizer_max_ppl_increase]``; the seed's 0.5 holds for fp8 through the planner, which
`rtx gates` checks).

Usage: python benchmarks/fp8_quality.py --model MODEL.gguf [--device cuda] [--json OUT.json]   (benchmarks/gpu.py real)
"""

from __future__ import annotations

import argparse
import json
import sys

from rtx_conformance.gates.config import load_gates
from rtxcore.bench.engine import build_engine
from rtxcore.quant.evaluation import backend_perplexity
from rtxcore.quant.pipeline import evaluation_tokens
from rtxcore.transfer import release_device_memory

EVAL_TOKENS = 512
CHUNK = 512


def score(model: str, device: str, dtype: str, quantization: str | None) -> float:
    engine = build_engine(model=model, device=device, dtype=dtype, quantization=quantization, enforce_eager=True,
                          max_model_len=CHUNK + 16)
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
           "fp8": score(args.model, args.device, "bfloat16", "fp8")}
    budget = load_gates(None).quality.quantizer_max_ppl_increase["fp8"]
    increase = ppl["fp8"] - ppl["bfloat16"]
    within = increase <= budget
    print(f"perplexity on {EVAL_TOKENS} held-out tokens ({args.device}): fp32 {ppl['float32']:.3f}, bf16 "
          f"{ppl['bfloat16']:.3f}, fp8 {ppl['fp8']:.3f}: fp8 - bf16 = {increase:+.3f} (budget +{budget}): "
          f"{'within' if within else 'OVER'}", flush=True)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"device": args.device, "tokens": EVAL_TOKENS, "perplexity": ppl,
                       "fp8_minus_bf16": increase, "budget": budget, "within_budget": within}, fh, indent=2)
    return 0 if within else 1


if __name__ == "__main__":
    sys.exit(main())
