"""Time the prefill-attention kernel's launch shapes on the GPU at ``llama-1b``'s heads (bfloat16, 32 query heads,
8 KV heads, head size 64, block size 16), beside torch's own causal attention (``scaled_dot_product_attention`` on
contiguous tensors, flash-attention where torch has it) on the same queries and keys in the same run.

Cases: W7's prompt (8,192 tokens in one chunk), a chunk of 2,048 at the end of an 8,192-token context (chunked
prefill), and 16 newcomers of 512 tokens (W2-like). Achieved FLOP/s count useful (causal) FLOPs only, as
rtxcore.bench.attention_flops does.

Usage: python benchmarks/prefill_attention_sweep.py [--json OUT.json] [--quick]
"""

from __future__ import annotations

import argparse
import inspect
import itertools
import json

import torch
import torch.nn.functional as F
import triton

from rtx_kernels.prefill_attention import prefill_attention
from rtxcore.bench.attention_flops import causal_attention_flops

H, KVH, D, BS = 32, 8, 64, 16
SCALE = D ** -0.5
# The kernel's own launch shape: rows, keys, warps, stages.
_DEFAULTS = inspect.signature(prefill_attention).parameters
DEFAULT_SHAPE = tuple(_DEFAULTS[k].default for k in ("block_rows", "block_n", "num_warps", "num_stages"))


def _flops(query_lens: list[int], seq_lens: list[int]) -> float:
    return sum(causal_attention_flops(q, 1, H, D, context_len=s - q) for q, s in zip(query_lens, seq_lens))


def _case(query_lens: list[int], seq_lens: list[int]):
    gen = torch.Generator(device="cuda").manual_seed(0)
    blocks_per_seq = -(-max(seq_lens) // BS)
    num_blocks = len(seq_lens) * blocks_per_seq + 1
    k = torch.randn(KVH, num_blocks, BS, D, device="cuda", generator=gen).bfloat16()
    v = torch.randn(KVH, num_blocks, BS, D, device="cuda", generator=gen).bfloat16()
    tables = (torch.randperm(num_blocks - 1, device="cuda", generator=gen)[:len(seq_lens) * blocks_per_seq] + 1)
    tables = tables.view(len(seq_lens), blocks_per_seq).int()
    q = torch.randn(sum(query_lens), H, D, device="cuda", generator=gen).bfloat16()
    starts = torch.tensor([0, *itertools.accumulate(query_lens)], dtype=torch.int32, device="cuda")
    return q, k, v, starts, torch.tensor(seq_lens, dtype=torch.int32, device="cuda"), tables


def _sdpa_ms(query_lens: list[int], seq_lens: list[int]) -> float:
    """torch's causal attention over contiguous K/V of the same sizes (one call per request, as its layout asks)."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    calls = []
    for ql, sl in zip(query_lens, seq_lens):
        q = torch.randn(1, H, ql, D, device="cuda", generator=gen).bfloat16()
        k = torch.randn(1, KVH, sl, D, device="cuda", generator=gen).bfloat16()
        v = torch.randn(1, KVH, sl, D, device="cuda", generator=gen).bfloat16()
        # A chunk after a context: an explicit mask (bottom-right causal); a whole prompt: is_causal.
        mask = None if ql == sl else torch.ones(ql, sl, dtype=torch.bool, device="cuda").tril(sl - ql)
        calls.append((q, k, v, mask))

    def run():
        for q, k, v, mask in calls:
            F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None, enable_gqa=True)
    return triton.testing.do_bench(run, warmup=5, rep=50, return_mode="median")


def sweep(name: str, query_lens: list[int], seq_lens: list[int], quick: bool) -> dict:
    q, k, v, starts, lens, tables = _case(query_lens, seq_lens)
    flops = _flops(query_lens, seq_lens)
    reference = prefill_attention(q, k, v, starts, lens, tables, SCALE, max(query_lens))
    shapes = [DEFAULT_SHAPE] if quick else itertools.product((64, 128, 256), (32, 64, 128), (4, 8), (2, 3, 4))
    rows = []
    for block_rows, block_n, warps, stages in shapes:
        def run(block_rows=block_rows, block_n=block_n, warps=warps, stages=stages):
            return prefill_attention(q, k, v, starts, lens, tables, SCALE, max(query_lens), block_rows=block_rows,
                                     block_n=block_n, num_warps=warps, num_stages=stages)
        try:
            error = (run().float() - reference.float()).abs().max().item()
            ms = triton.testing.do_bench(run, warmup=5, rep=50, return_mode="median")
        except Exception as exc:  # a shape the compiler refuses (e.g. too much shared memory)
            rows.append({"block_rows": block_rows, "block_n": block_n, "warps": warps, "stages": stages,
                         "error": type(exc).__name__})
            continue
        rows.append({"block_rows": block_rows, "block_n": block_n, "warps": warps, "stages": stages, "ms": ms,
                     "tflops": flops / ms / 1e9, "max_abs_diff_vs_default": error})
    rows.sort(key=lambda r: r.get("ms", float("inf")))
    sdpa = _sdpa_ms(query_lens, seq_lens)
    print(f"\n{name}: {len(query_lens)} chunks of {query_lens[0]} tokens, contexts {seq_lens[0]}; "
          f"torch sdpa {sdpa:.3f} ms ({flops / sdpa / 1e9:.1f} TFLOP/s)")
    for r in rows[:8] + [r for r in rows if (r["block_rows"], r["block_n"], r["warps"], r["stages"]) == DEFAULT_SHAPE]:
        if "ms" in r:
            print(f"  rows {r['block_rows']:3} keys {r['block_n']:3} warps {r['warps']} stages {r['stages']}: "
                  f"{r['ms']:.3f} ms, {r['tflops']:.1f} TFLOP/s, max |diff| {r['max_abs_diff_vs_default']:.2e}")
    return {"query_lens": query_lens, "seq_lens": seq_lens, "flops": flops, "sdpa_ms": sdpa,
            "sdpa_tflops": flops / sdpa / 1e9, "shapes": rows}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--json", default=None)
    p.add_argument("--quick", action="store_true", help="the default launch shape only")
    args = p.parse_args()
    results = {
        "w7_prompt": sweep("W7 prompt", [8192], [8192], args.quick),
        "chunk_after_context": sweep("chunk after context", [2048], [8192], args.quick),
        "newcomers": sweep("newcomers", [512] * 16, [512] * 16, args.quick),
    }
    results["device"] = torch.cuda.get_device_name()
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(results, fh, indent=2)


if __name__ == "__main__":
    main()
