"""Time the decode-attention kernel's launch shapes on the GPU at ``llama-8b``'s heads (32 query heads, 8 KV heads,
head size 128, block size 16, bfloat16 queries; ``--heads llama-1b``: head size 64) over a bfloat16 cache and an fp8
one (``--kv-cache-dtype fp8``), beside the kernel's own default shape in the same run.

Cases: W8B's decode (256 requests, contexts uniform in [128, 256]) and a W2-like one (64 requests, contexts uniform
in [100, 2048]). Each shape is timed with CUDA events over 50 calls after 5 warm-up calls; the achieved bandwidth
counts the K/V bytes each call must read (every request's context once), so an fp8 cache that halves the time shows
the same GB/s.

``--splits 1,2,4`` times each shape at those split counts too (default: the kernel's own choice alone);
``--partitions 256,512`` in fixed partitions of those many tokens as well (as many splits as the longest context
needs; a long context gets more programs than a short one).

Usage: python benchmarks/decode_attention_sweep.py [--json OUT.json] [--quick] [--heads llama-1b] [--splits N,...]
       [--partitions TOKENS,...]
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json

import torch

from rtx_kernels.decode_attention import choose_num_splits, decode_attention

BS = 16
HEADS = {"llama-8b": (32, 8, 128), "llama-1b": (32, 8, 64)}  # query heads, kv heads, head size
CASES = {"W8B 256 x [128, 256]": (256, 128, 256), "W2-like 64 x [100, 2048]": (64, 100, 2048)}


def _case(batch: int, low: int, high: int, cache_dtype: torch.dtype, heads: tuple[int, int, int]):
    num_heads, kv_heads, head_size = heads
    gen = torch.Generator(device="cuda").manual_seed(0)
    seq_lens = torch.randint(low, high + 1, (batch,), device="cuda", generator=gen, dtype=torch.int32)
    blocks_per_seq = -(-high // BS)
    num_blocks = batch * blocks_per_seq + 1
    k = torch.randn(kv_heads, num_blocks, BS, head_size, device="cuda", generator=gen).to(cache_dtype)
    v = torch.randn(kv_heads, num_blocks, BS, head_size, device="cuda", generator=gen).to(cache_dtype)
    tables = (torch.randperm(num_blocks - 1, device="cuda", generator=gen) + 1).view(batch, blocks_per_seq).int()
    q = torch.randn(batch, num_heads, head_size, device="cuda", generator=gen).bfloat16()
    return q, k, v, tables, seq_lens


def _time_ms(fn, calls: int = 50) -> float:
    for _ in range(5):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(calls):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / calls


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", default=None, help="also write the results here")
    parser.add_argument("--quick", action="store_true", help="only the default shape and a few others")
    parser.add_argument("--heads", choices=sorted(HEADS), default="llama-8b", help="the model whose heads to use")
    parser.add_argument("--splits", default=None, help="split counts to time besides the kernel's choice: 1,2,4")
    parser.add_argument("--partitions", default=None, help="fixed partition sizes to time as well: 256,512")
    args = parser.parse_args()
    _, kv_heads, head_size = HEADS[args.heads]
    shapes = [(None, 4, 3)] + list(itertools.product((64, 128, 256), (4, 8), (2, 3, 4)))
    if args.quick:
        shapes = shapes[:1] + [(128, 8, 3), (256, 8, 3), (256, 8, 2)]
    results = []
    for (name, (batch, low, high)), cache_dtype in itertools.product(CASES.items(),
                                                                    (torch.bfloat16, torch.float8_e4m3fn)):
        q, k, v, tables, lens = _case(batch, low, high, cache_dtype, HEADS[args.heads])
        chosen = choose_num_splits(batch, kv_heads, high)
        split_counts: list[tuple[int, int | None]] = [
            (n, None) for n in sorted({chosen, *(int(n) for n in args.splits.split(","))} if args.splits else {chosen})]
        split_counts += [(-(-high // int(p)), int(p)) for p in args.partitions.split(",")] if args.partitions else []
        kv_bytes = 2 * int(lens.sum()) * kv_heads * head_size * cache_dtype.itemsize
        out = torch.empty_like(q)
        for (block_n, warps, stages), (splits, partition) in itertools.product(shapes, split_counts):
            try:
                ms = _time_ms(functools.partial(decode_attention, q, k, v, tables, lens, head_size ** -0.5, splits,
                                                out=out, block_n=block_n, num_warps=warps, num_stages=stages,
                                                partition_size=partition))
            except Exception as exc:  # a shape that does not compile (shared memory): noted, not fatal
                print(f"{name} {cache_dtype} {block_n}/{warps}/{stages}: {type(exc).__name__}")
                continue
            row = {"case": name, "heads": args.heads, "cache": str(cache_dtype).removeprefix("torch."),
                   "splits": splits, "partition": partition, "chosen_splits": chosen,
                   "block_n": block_n or "default", "num_warps": warps, "num_stages": stages,
                   "us": round(1000 * ms, 1), "GB/s": round(kv_bytes / ms / 1e6)}
            results.append(row)
            print(json.dumps(row), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
