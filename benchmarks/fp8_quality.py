"""fp8 against bf16 (and fp32) on the default model's real weights, as the engine runs them: perplexity of the quality
gate's held-out text (the first 512 tokens of the evaluation half of CPython's pydoc topics), each precision scored by
an engine's own backend (fp8: weights quantized at load, per-token activation scales, fp8 GEMMs on a GPU that has
them, there also with cuBLAS's fast accumulation, ``RTX_FP8_FAST_ACCUM``); then an fp8 KV cache
(``--kv-cache-dtype fp8``) under the bf16 and fp32 models; then, on a GPU where the Triton fp8 GEMM applies
(``rtx_kernels.fp8_matmul``, Hopper), bf16 and fp8 again in pieces short enough for it, fp8's GEMMs in cuBLAS and in
that kernel (``RTX_FP8_TRITON_GEMM=0/1``). Fails (exit 1) when fp8 weights (any of these GEMMs) raise perplexity over
bf16 by more than spec/gates.toml's budget for fp8 with every layer quantized
(``[quality.quantizer_max_ppl_increase]``; the seed's 0.5 holds for fp8 through the planner, which `rtx gates`
checks), or an fp8 KV cache raises it past ``FP8_KV_CACHE_MAX_PPL_RATIO`` times the model's own cache's.

Usage: python benchmarks/fp8_quality.py --model MODEL.gguf [--device cuda] [--json OUT.json]   (benchmarks/gpu.py real)
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

from rtx_conformance.gates.config import load_gates
from rtx_kernels import fp8_matmul
from rtx_plugins.quantizers import fp8 as fp8_plugin
from rtxcore.bench.engine import build_engine
from rtxcore.quant.evaluation import FP8_KV_CACHE_MAX_PPL_RATIO, backend_perplexity
from rtxcore.quant.pipeline import evaluation_tokens
from rtxcore.transfer import release_device_memory

EVAL_TOKENS = 512
CHUNK = 512


def score(model: str, device: str, dtype: str, quantization: str | None, kv_cache_dtype: str = "auto",
          chunk: int = CHUNK) -> float:
    engine = build_engine(model=model, device=device, dtype=dtype, quantization=quantization, enforce_eager=True,
                          max_model_len=chunk + 16, kv_cache_dtype=kv_cache_dtype)
    tokens = evaluation_tokens(engine.core.source, EVAL_TOKENS)
    ppl = backend_perplexity(engine.core.backend, tokens, chunk)
    del engine
    release_device_memory()
    return ppl


# Pieces this short make every product of a prefill small enough for the Triton fp8 GEMM.
PIECE = fp8_matmul.MAX_ROWS


def _with_switch(name: str, value: str, cached, fn):
    """``fn()`` with the environment switch ``name`` set to ``value``; ``cached`` is the functools.cache that reads it
    once per process, cleared around the call."""
    os.environ[name] = value
    cached.cache_clear()
    try:
        return fn()
    finally:
        del os.environ[name]
        cached.cache_clear()


def score_fast_accumulation(model: str, device: str) -> float:
    """fp8 with cuBLAS's fast accumulation (``RTX_FP8_FAST_ACCUM=1``); the same as plain fp8 where no GPU runs it."""
    return _with_switch("RTX_FP8_FAST_ACCUM", "1", fp8_plugin._fast_accumulation,
                        lambda: score(model, device, "bfloat16", "fp8"))


def score_short_pieces(model: str, device: str) -> dict[str, float]:
    """bf16 and fp8 in pieces of :data:`PIECE` tokens, fp8's GEMMs in cuBLAS and in the Triton kernel; empty where
    that kernel does not apply (no Hopper GPU)."""
    if not (device.startswith("cuda") and torch.cuda.get_device_capability(torch.device(device))[0] == 9):
        return {}
    ppl = {"bfloat16, short pieces": score(model, device, "bfloat16", None, chunk=PIECE)}
    for name, switch in (("cuBLAS", "0"), ("Triton GEMM", "1")):
        ppl[f"fp8, short pieces, {name}"] = _with_switch("RTX_FP8_TRITON_GEMM", switch, fp8_matmul._applies_on,
                                                         lambda: score(model, device, "bfloat16", "fp8", chunk=PIECE))
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
           "fp8, fast accumulation": score_fast_accumulation(args.model, args.device),
           "bfloat16, fp8 KV cache": score(args.model, args.device, "bfloat16", None, "fp8"),
           "float32, fp8 KV cache": score(args.model, args.device, "float32", None, "fp8")}
    budget = load_gates(None).quality.quantizer_max_ppl_increase["fp8"]
    increase = ppl["fp8"] - ppl["bfloat16"]
    fast_increase = ppl["fp8, fast accumulation"] - ppl["bfloat16"]
    kv_ratios = {dtype: ppl[f"{dtype}, fp8 KV cache"] / ppl[dtype] for dtype in ("bfloat16", "float32")}
    within = max(increase, fast_increase) <= budget and max(kv_ratios.values()) <= FP8_KV_CACHE_MAX_PPL_RATIO
    short = score_short_pieces(args.model, args.device)
    ppl.update(short)
    if short:
        triton_increase = short["fp8, short pieces, Triton GEMM"] - short["bfloat16, short pieces"]
        within = within and triton_increase <= budget
        print(f"in pieces of {PIECE} tokens: bf16 {short['bfloat16, short pieces']:.3f}, fp8 with cuBLAS "
              f"{short['fp8, short pieces, cuBLAS']:.3f}, with the Triton GEMM "
              f"{short['fp8, short pieces, Triton GEMM']:.3f} ({triton_increase:+.3f} over bf16)", flush=True)
    print(f"perplexity on {EVAL_TOKENS} held-out tokens ({args.device}): fp32 {ppl['float32']:.3f}, bf16 "
          f"{ppl['bfloat16']:.3f}, fp8 {ppl['fp8']:.3f}: fp8 - bf16 = {increase:+.3f} (budget +{budget}); fp8 with "
          f"cuBLAS's fast accumulation {ppl['fp8, fast accumulation']:.3f} ({fast_increase:+.3f})", flush=True)
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
