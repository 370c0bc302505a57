"""Time the decode-attention kernel's launch shapes on the GPU at the serving shapes of ``llama-1b`` (bfloat16,
32 query heads, 8 KV heads, head size 64, block size 16) and print them fastest first, with the bytes-moved floor.

With ``--splits``, times instead each number of sequence splits at W2-like contexts (lengths uniform in
[100, 2048], as when requests of W2 decode together) for several batch sizes, beside the split count
:func:`choose_num_splits` picks for them.

With ``--layers``, times launch shapes at W2-like contexts as a decode step runs
them: 16 layers' calls, each on its own cache, replayed from one CUDA graph.

With ``--w3``, times each number of splits the way W3's decode graph runs attention on ``llama-8b`` (32 query
heads, 8 KV heads, head size 128): one request at contexts of 128 to 384 tokens, layers' calls in one CUDA graph,
each on its own cache, over enough caches that K/V come from HBM. The
graph's split count comes from ``--max-model-len`` (:func:`choose_num_splits`), not from the context.

Usage: python benchmarks/kernel_sweep.py [--splits | --layers | --w3]
"""

from __future__ import annotations

import itertools
import sys

import torch
import triton

from rtx_kernels.decode_attention import choose_num_splits, decode_attention

H, KVH, D, BS = 32, 8, 64, 16
COPY_BW = 4.24e12  # bytes/s, device-to-device copy measured on the H200 (shared/ENVIRONMENT.md)


def _inputs(lens: torch.Tensor, heads: tuple[int, int, int] = (H, KVH, D)):
    """q, caches and block tables for requests of the given context lengths, blocks scattered over the cache."""
    num_heads, num_kv_heads, head_size = heads
    gen = torch.Generator(device="cuda").manual_seed(0)
    batch = lens.numel()
    blocks_per_seq = -(-int(lens.max()) // BS)
    num_blocks = batch * blocks_per_seq + 1
    k = torch.randn(num_kv_heads, num_blocks, BS, head_size, device="cuda", generator=gen).bfloat16()
    v = torch.randn(num_kv_heads, num_blocks, BS, head_size, device="cuda", generator=gen).bfloat16()
    tables = (torch.randperm(num_blocks - 1, device="cuda", generator=gen)[: batch * blocks_per_seq] + 1)
    tables = tables.view(batch, blocks_per_seq).int()
    q = torch.randn(batch, num_heads, head_size, device="cuda", generator=gen).bfloat16()
    floor_us = 2 * int(lens.sum()) * num_kv_heads * head_size * 2 / COPY_BW * 1e6
    return q, k, v, tables, lens.int().cuda(), floor_us


def _graph_us_per_layer(layers, splits: int, **shape) -> float:
    """One decode step's attention calls, one per layer on its own cache, replayed from a CUDA graph: us a layer."""
    def step():
        for q, k, v, tables, seq_lens, _ in layers:
            decode_attention(q, k, v, tables, seq_lens, 0.125, splits, **shape)

    step()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(20):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 20 / len(layers) * 1000


def case(batch: int, ctx: int, splits: int):
    q, k, v, tables, lens, floor_us = _inputs(torch.full((batch,), ctx))
    rows = []
    for block_n, warps, stages in itertools.product((32, 64, 128), (2, 4, 8), (1, 2, 3)):
        try:
            ms = triton.testing.do_bench(lambda: decode_attention(q, k, v, tables, lens, 0.125, splits, block_n=block_n,
                                                                  num_warps=warps, num_stages=stages),
                                         warmup=5, rep=20, return_mode="median")
        except Exception as exc:  # a shape the compiler refuses (e.g. too much shared memory)
            rows.append((float("inf"), block_n, warps, stages, type(exc).__name__))
            continue
        rows.append((ms * 1000, block_n, warps, stages, ""))
    rows.sort()
    print(f"\nbatch {batch}, context {ctx}, splits {splits}: K/V read floor {floor_us:.1f} us")
    for us, block_n, warps, stages, err in rows[:6] + [r for r in rows if (r[1], r[2], r[3]) == (64, 4, 3)]:
        print(f"  block_n={block_n:3d} warps={warps} stages={stages}: {us:8.1f} us {err}")


def splits_case(batch: int) -> None:
    lens = torch.randint(100, 2049, (batch,), generator=torch.Generator().manual_seed(batch))
    q, k, v, tables, lens, floor_us = _inputs(lens)
    chosen = choose_num_splits(batch, KVH, 4096)
    print(f"\nbatch {batch}, contexts uniform in [100, 2048]: K/V read floor {floor_us:.1f} us; "
          f"choose_num_splits(max_len=4096) = {chosen}")
    for splits in (1, 2, 3, 4, 6, 8, 12, 16, 32):
        ms = triton.testing.do_bench(lambda: decode_attention(q, k, v, tables, lens, 0.125, splits),
                                     warmup=5, rep=30, return_mode="median")
        print(f"  splits={splits:2d}: {ms * 1000:8.1f} us  ({floor_us / (ms * 1000):.0%} of the floor)")


def layers_case(batch: int, num_layers: int = 16) -> None:
    """Launch shapes timed the way a decode step runs them: one call per layer, each on its own cache, captured in
    one CUDA graph, so K/V come from HBM (a single cache of W2's contexts fits in the 50 MB L2 and reads too fast)."""
    lens = torch.randint(100, 2049, (batch,), generator=torch.Generator().manual_seed(batch))
    layers = [_inputs(lens) for _ in range(num_layers)]
    floor_us = layers[0][5]
    chosen = choose_num_splits(batch, KVH, 4096)
    rows = []
    for splits, block_n, warps, stages in itertools.product(
            sorted({max(1, chosen // 2), chosen, chosen * 2}), (32, 64, 128), (2, 4, 8), (1, 3)):
        shape = dict(block_n=block_n, num_warps=warps, num_stages=stages)
        try:
            us = _graph_us_per_layer(layers, splits, **shape)
        except Exception as exc:  # a shape the compiler refuses (e.g. too much shared memory)
            print(f"  {splits=} {shape}: {type(exc).__name__}")
            continue
        rows.append((us, splits, shape))
    rows.sort(key=lambda r: r[0])
    print(f"\nbatch {batch}, contexts uniform in [100, 2048], {num_layers} layers in one graph: floor {floor_us:.1f} us "
          f"per layer; choose_num_splits = {chosen}")
    default = [r for r in rows if r[1] == chosen and r[2] == dict(block_n=64 if chosen > 1 else 128, num_warps=4,
                                                                   num_stages=3)]
    for us, splits, shape in rows[:8] + default:
        print(f"  {us:7.1f} us per layer  splits={splits} {shape}")


def w3_case(ctx: int, num_layers: int = 32, max_model_len: int = 4096) -> None:
    """W3's decode attention on llama-8b: one request at context ``ctx``, every split count, default tiles.

    In W3's step the weights stream between two attentions and push the KV cache out of L2; here 32 layers' caches
    alone would fit in it, so the graph walks enough caches to fill twice the L2 (in whole steps of 32 layers)."""
    layer_bytes = 2 * 8 * (-(-ctx // BS) * BS) * 128 * 2
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    num_caches = num_layers * -(-2 * l2 // (num_layers * layer_bytes))
    layers = [_inputs(torch.tensor([ctx]), heads=(32, 8, 128)) for _ in range(num_caches)]
    chosen = choose_num_splits(1, 8, max_model_len)
    print(f"\nllama-8b heads, one request, context {ctx}, {num_caches} layers' caches in one graph: floor "
          f"{layers[0][5]:.2f} us per layer; the decode graph's choose_num_splits(max_len={max_model_len}) = {chosen}, "
          f"an eager step's = {choose_num_splits(1, 8, ctx)}")
    for splits in (1, 2, 4, 8, 16, 32):
        print(f"  splits={splits:2d}: {_graph_us_per_layer(layers, splits):7.2f} us per layer")


def main() -> None:
    if "--w3" in sys.argv[1:]:
        for ctx in (128, 256, 384):
            w3_case(ctx)
        return
    if "--layers" in sys.argv[1:]:
        for batch in (32, 64, 128):
            layers_case(batch)
        return
    if "--splits" in sys.argv[1:]:
        for batch in (1, 8, 16, 32, 64, 128, 256):
            splits_case(batch)
        return
    for batch, ctx in ((1, 384), (256, 384), (64, 1024)):
        case(batch, ctx, choose_num_splits(batch, KVH, ctx))
    case(1, 384, 16)


if __name__ == "__main__":
    main()
