"""fp8 against bf16 (and fp32) on the default model's real weights, as the engine runs them: perplexity of the quality
gate's held-out text (the first 512 tokens of the evaluation half of CPython's pydoc topics), each precision scored by
an engine's own backend (fp8: weights quantized at load, per-token activation scales, fp8 GEMMs on a GPU that has
them); then an fp8 KV cache (``--kv-cache-dtype fp8``) under the bf16 and fp32 models. Fails (exit 1) when fp8
weights raise perplexity over bf16 by more than spec/gates.toml's budget for fp8 with every layer quantized
(``[quality.quantizer_max_ppl_increase]``; the seed's 0.5 holds for fp8 through the planner, which `rtx gates`
checks), or an fp8 KV cache raises it past ``FP8_KV_CACHE_MAX_PPL_RATIO`` times the model's own cache's.

fp8 is scored as the engine runs it by default, cuBLAS's fast accumulation included (``RTX_FP8_FAST_ACCUM``). Then
the fp8 GEMMs' other settings, reported against the same budget without deciding the exit status: cuBLAS's other
accumulation mode on a GPU with fp8 tensor cores, and on Hopper the Triton fp8 GEMM (``RTX_FP8_TRITON_GEMM``), scored
with bf16 and plain fp8 in pieces short enough for it.

Usage: python benchmarks/fp8_quality.py --model MODEL.gguf [--device cuda] [--json OUT.json]   (benchmarks/gpu.py real)
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from collections.abc import Iterator
from unittest import mock

import torch

from rtx_conformance.gates.config import load_gates
from rtx_kernels import quant_reference
from rtx_plugins.quantizers import fp8 as fp8_plugin
from rtxcore import envs
from rtxcore.bench.engine import build_engine
from rtxcore.quant.evaluation import FP8_KV_CACHE_MAX_PPL_RATIO, backend_perplexity
from rtxcore.quant.pipeline import evaluation_tokens
from rtxcore.transfer import release_device_memory

EVAL_TOKENS = 512
CHUNK = 512
# Pieces this short make every product of a prefill small enough for the Triton fp8 GEMM (its MAX_ROWS).
PIECE = 64


def _clear_switch_caches() -> None:
    # Both switches are read once per process; clearing lets the next engine read them again.
    fp8_plugin._fast_accumulation.cache_clear()
    if quant_reference.HAS_TRITON:
        from rtx_kernels import fp8_matmul

        fp8_matmul._applies_on.cache_clear()


@contextlib.contextmanager
def fp8_switches(fast_accum: bool = False, triton_gemm: bool = False) -> Iterator[None]:
    """Pin both fp8 GEMM switches for what runs inside, whatever the caller's environment says, and restore it."""
    values = {"RTX_FP8_FAST_ACCUM": str(int(fast_accum)), "RTX_FP8_TRITON_GEMM": str(int(triton_gemm))}
    with mock.patch.dict(os.environ, values):
        _clear_switch_caches()
        try:
            yield
        finally:
            _clear_switch_caches()


def score(model: str, device: str, dtype: str, quantization: str | None, kv_cache_dtype: str = "auto",
          chunk: int = CHUNK, fast_accum: bool = False, triton_gemm: bool = False) -> float:
    with fp8_switches(fast_accum, triton_gemm):
        engine = build_engine(model=model, device=device, dtype=dtype, quantization=quantization,
                              enforce_eager=True, max_model_len=chunk + 16, kv_cache_dtype=kv_cache_dtype)
        tokens = evaluation_tokens(engine.core.source, EVAL_TOKENS)
        ppl = backend_perplexity(engine.core.backend, tokens, chunk)
        del engine
    release_device_memory()
    return ppl


def _capability(device: str) -> tuple[int, int]:
    return torch.cuda.get_device_capability(torch.device(device)) if device.startswith("cuda") else (0, 0)


# The engine's default accumulation (RTX_FP8_FAST_ACCUM), which the "fp8" score and the exit status use.
FAST_ACCUM = envs.RTX_FP8_FAST_ACCUM.default
OTHER_ACCUMULATION = "fp8, cuBLAS's default accumulation" if FAST_ACCUM else "fp8, fast accumulation"


def score_options(model: str, device: str) -> dict[str, float]:
    """The fp8 GEMMs' options, where a GPU runs them: cuBLAS's other accumulation mode (fp8 tensor cores, 8.9 and
    up), and on Hopper bf16 and fp8 in pieces of :data:`PIECE` tokens with the GEMMs in cuBLAS and in the Triton
    kernel."""
    ppl: dict[str, float] = {}
    if _capability(device) >= (8, 9):
        ppl[OTHER_ACCUMULATION] = score(model, device, "bfloat16", "fp8", fast_accum=not FAST_ACCUM)
    if _capability(device)[0] == 9:
        ppl["bfloat16, short pieces"] = score(model, device, "bfloat16", None, chunk=PIECE)
        ppl["fp8, short pieces, cuBLAS"] = score(model, device, "bfloat16", "fp8", chunk=PIECE, fast_accum=FAST_ACCUM)
        ppl["fp8, short pieces, Triton GEMM"] = score(model, device, "bfloat16", "fp8", chunk=PIECE,
                                                      fast_accum=FAST_ACCUM, triton_gemm=True)
    return ppl


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--device", default="cuda")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    ppl = {"float32": score(args.model, args.device, "float32", None),
           "bfloat16": score(args.model, args.device, "bfloat16", None),
           "fp8": score(args.model, args.device, "bfloat16", "fp8", fast_accum=FAST_ACCUM),
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

    # The options (not the defaults) are reported against the same budget but do not decide the exit status.
    options = score_options(args.model, args.device)
    ppl.update(options)
    option_increases = {}
    if OTHER_ACCUMULATION in options:
        option_increases[OTHER_ACCUMULATION] = options[OTHER_ACCUMULATION] - ppl["bfloat16"]
    if "bfloat16, short pieces" in options:
        for gemm in ("cuBLAS", "Triton GEMM"):
            name = f"fp8, short pieces, {gemm}"
            option_increases[name] = options[name] - options["bfloat16, short pieces"]
    for name, rise in option_increases.items():
        base = "bf16 in the same pieces" if "short pieces" in name else "bf16"
        print(f"{name}: {ppl[name]:.3f}, {rise:+.3f} over {base} ({'within' if rise <= budget else 'OVER'} the "
              f"budget)", flush=True)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"device": args.device, "tokens": EVAL_TOKENS, "perplexity": ppl,
                       "fp8_minus_bf16": increase, "budget": budget, "fp8_kv_cache_ratios": kv_ratios,
                       "fp8_kv_cache_budget": FP8_KV_CACHE_MAX_PPL_RATIO, "within_budget": within,
                       "options_minus_bf16": option_increases}, fh, indent=2)
    return 0 if within else 1


if __name__ == "__main__":
    sys.exit(main())
