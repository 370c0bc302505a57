"""The Triton attention kernels (paged decode, chunked prefill) equal their torch references.

The tests poison every cache slot that no request owns (the null block, spare blocks, the tail of each last block)
and the output buffer with NaN, so a missing mask or an unwritten element shows up as a NaN.

The interpreter cannot run ``tl.dot`` on bfloat16 (it multiplies the raw bit patterns; triton-lang/triton#11584,
closed as unsupported), so on the CPU the attention kernels are checked in fp32 and fp16 only, and with bfloat16
queries over an fp8 cache, where the matmuls run in fp16.
"""

from __future__ import annotations

import math

import pytest
import torch

from rtx_kernels.decode_attention import (
    DecodeWorkspace,
    choose_num_splits,
    decode_attention,
    unsplit_block_n,
)
from rtx_kernels.prefill_attention import prefill_attention
from rtx_kernels.reference import decode_attention_ref, prefill_attention_ref
from tests.helpers.triton import DEVICE, ON_GPU, generator, paged_cache, randn

ATTENTION_DTYPES = [torch.float32, torch.float16, torch.bfloat16] if ON_GPU else [torch.float32, torch.float16]
# (max abs error, relative Frobenius error) against a float32 reference.
ATTENTION_TOLERANCE = {torch.float32: (1e-4, 1e-5), torch.float16: (5e-3, 2e-3), torch.bfloat16: (2e-2, 1e-2)}


def _assert_attention_close(out: torch.Tensor, ref: torch.Tensor, dtype) -> None:
    assert out.dtype == dtype
    assert torch.isfinite(out).all(), "an output element was not written or read a masked slot"
    max_abs, rel = ATTENTION_TOLERANCE[dtype]
    err = (out.float() - ref).abs().max().item()
    rel_err = ((out.float() - ref).norm() / ref.norm().clamp_min(1e-12)).item()
    assert err <= max_abs and rel_err <= rel, f"max abs error {err:.2e}, relative error {rel_err:.2e}"


# (num_heads, num_kv_heads, head_size, block_size, seq_lens, num_splits)
if ON_GPU:
    _lens = torch.randint(1, 2049, (256,), generator=torch.Generator().manual_seed(0)).tolist()
    _lens[::37] = [0] * len(_lens[::37])
    DECODE_CASES = [
        pytest.param(32, 8, 128, 16, _lens, 1, id="b256-gqa4-d128-nosplit"),
        pytest.param(32, 8, 64, 16, _lens[:64], 2, id="b64-gqa4-d64-split2"),
        pytest.param(8, 8, 128, 16, _lens[:4], 32, id="b4-mha-d128-split32"),
        pytest.param(32, 4, 128, 16, [2048, 1, 0, 17], 16, id="b4-gqa8-d128-split16"),
        pytest.param(32, 8, 64, 16, [5, 3, 0, 16], 64, id="more-splits-than-blocks"),
    ]
else:
    DECODE_CASES = [
        pytest.param(2, 2, 16, 4, [0, 1, 4, 9, 23], 1, id="mha-nosplit"),
        pytest.param(4, 2, 32, 8, [5, 0, 17, 40], 3, id="gqa2-split3"),
        pytest.param(8, 2, 16, 4, [3, 30, 0, 12], 16, id="gqa4-more-splits-than-blocks"),
    ]


@pytest.mark.parametrize("dtype", ATTENTION_DTYPES, ids=str)
@pytest.mark.parametrize("num_heads, num_kv_heads, head_size, block_size, seq_lens, num_splits", DECODE_CASES)
def test_decode_attention_matches_reference(num_heads, num_kv_heads, head_size, block_size, seq_lens, num_splits,
                                            dtype):
    gen = generator(len(seq_lens) + num_splits)
    k_cache, v_cache, block_tables = paged_cache(seq_lens, num_kv_heads, block_size, head_size, dtype, gen)
    q = randn(len(seq_lens), num_heads, head_size, gen=gen, dtype=dtype)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    scale = head_size**-0.5
    out = torch.full_like(q, float("nan"))

    got = decode_attention(q, k_cache, v_cache, block_tables, lens, scale, num_splits, out=out)

    assert got is out
    _assert_attention_close(out, decode_attention_ref(q, k_cache, v_cache, block_tables, lens, scale), dtype)
    assert (out[lens == 0] == 0).all()


# (num_heads, num_kv_heads, head_size, block_size, seq_lens, partition_size, num_splits)
PARTITION_CASES = [
    pytest.param(32, 8, 64, 16, _lens[:64], 512, 4, id="b64-gqa4-d64-p512") if ON_GPU else
    pytest.param(4, 2, 32, 4, [0, 1, 4, 9, 23], 8, 3, id="gqa2-p8"),
    pytest.param(4, 2, 32, 4, [5, 0, 17, 40], 4, 16, id="gqa2-p4-splits-past-every-context"),
]


@pytest.mark.parametrize("dtype", ATTENTION_DTYPES, ids=str)
@pytest.mark.parametrize("num_heads, num_kv_heads, head_size, block_size, seq_lens, partition_size, num_splits",
                         PARTITION_CASES)
def test_decode_attention_in_fixed_partitions_matches_reference(num_heads, num_kv_heads, head_size, block_size,
                                                                seq_lens, partition_size, num_splits, dtype):
    gen = generator(len(seq_lens) + partition_size)
    k_cache, v_cache, block_tables = paged_cache(seq_lens, num_kv_heads, block_size, head_size, dtype, gen)
    q = randn(len(seq_lens), num_heads, head_size, gen=gen, dtype=dtype)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    out = torch.full_like(q, float("nan"))

    decode_attention(q, k_cache, v_cache, block_tables, lens, head_size**-0.5, num_splits, out=out,
                     partition_size=partition_size)

    _assert_attention_close(out, decode_attention_ref(q, k_cache, v_cache, block_tables, lens, head_size**-0.5),
                            dtype)
    assert (out[lens == 0] == 0).all()


def test_decode_attention_partitions_hold_their_size():
    # Two splits of 8 tokens read the first 16 of each context, whatever its length: the partition, not an equal
    # share of the context, sets what a split covers.
    gen = generator(5)
    seq_lens = [40, 9, 16, 3]
    k_cache, v_cache, block_tables = paged_cache(seq_lens, 2, 4, 32, torch.float32, gen)
    q = randn(len(seq_lens), 4, 32, gen=gen, dtype=torch.float32)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    out = decode_attention(q, k_cache, v_cache, block_tables, lens, 0.2, 2, partition_size=8)
    _assert_attention_close(out, decode_attention_ref(q, k_cache, v_cache, block_tables, lens.clamp(max=16), 0.2),
                            torch.float32)


def test_decode_attention_refuses_a_partition_off_the_blocks():
    k_cache = torch.zeros(2, 3, 4, 16, device=DEVICE)
    q = torch.zeros(1, 2, 16, device=DEVICE)
    tables = torch.zeros(1, 2, dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="multiple of the block size 4"):
        decode_attention(q, k_cache, k_cache, tables, torch.ones(1, dtype=torch.int32, device=DEVICE), 1.0, 2,
                         partition_size=6)


def test_decode_attention_reuses_a_larger_workspace():
    gen = generator(7)
    seq_lens, num_splits = [9, 0, 21], 4
    k_cache, v_cache, block_tables = paged_cache(seq_lens, 2, 4, 16, torch.float32, gen)
    q = randn(3, 4, 16, gen=gen)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    workspace = DecodeWorkspace.allocate(8, 4, 6, 16, DEVICE)
    workspace.partial_out.fill_(float("nan"))

    out = decode_attention(q, k_cache, v_cache, block_tables, lens, 0.25, num_splits, workspace=workspace)

    _assert_attention_close(out, decode_attention_ref(q, k_cache, v_cache, block_tables, lens, 0.25), torch.float32)


FP8 = torch.float8_e4m3fn
# Over an fp8 cache a bfloat16 query's matmuls run in float16 (rtx_kernels.fp8_cache), which the interpreter's
# tl.dot takes too; a float32 model's stay in float32.
FP8_QUERY_DTYPES = [torch.float32, torch.float16, torch.bfloat16]


@pytest.mark.parametrize("dtype", FP8_QUERY_DTYPES, ids=str)
@pytest.mark.parametrize("num_heads, num_kv_heads, head_size, block_size, seq_lens, num_splits",
                         DECODE_CASES[:2])
def test_decode_attention_reads_an_fp8_cache(num_heads, num_kv_heads, head_size, block_size, seq_lens, num_splits,
                                             dtype):
    """Keys and values widen exactly from fp8, so the result is as close to the reference over the same fp8 cache
    as a cache of the query's own dtype would be."""
    gen = generator(len(seq_lens) + 100)
    k_cache, v_cache, block_tables = paged_cache(seq_lens, num_kv_heads, block_size, head_size, FP8, gen)
    q = randn(len(seq_lens), num_heads, head_size, gen=gen, dtype=dtype)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    out = torch.full_like(q, float("nan"))

    decode_attention(q, k_cache, v_cache, block_tables, lens, head_size**-0.5, num_splits, out=out)

    ref = decode_attention_ref(q, k_cache, v_cache, block_tables, lens, head_size**-0.5)
    _assert_attention_close(out, ref, dtype)


@pytest.mark.parametrize("batch, kv_heads, hint, expected", [
    (1, 8, 4096, 16), (1, 8, 300, 1), (4, 8, 2048, 8), (32, 8, 4096, 4), (64, 8, 4096, 1), (128, 8, 4096, 1),
    (256, 8, 128, 1), (1, 1, 1 << 20, 32)])
def test_choose_num_splits(batch, kv_heads, hint, expected):
    assert choose_num_splits(batch, kv_heads, hint) == expected


@pytest.mark.parametrize("head_size, itemsize, expected", [(64, 2, 128), (128, 2, 64), (128, 1, 128), (64, 1, 128),
                                                           (128, 4, 64), (256, 2, 64)])
def test_unsplit_tiles_hold_16_kib_of_keys_within_the_measured_sizes(head_size, itemsize, expected):
    assert unsplit_block_n(head_size, itemsize) == expected


# (num_heads, num_kv_heads, head_size, block_size, query_lens, prefix_lens)
if ON_GPU:
    _gen = torch.Generator().manual_seed(1)
    _qlens = torch.randint(1, 513, (8,), generator=_gen).tolist()
    _prefixes = torch.randint(0, 1537, (8,), generator=_gen).tolist()
    PREFILL_CASES = [
        pytest.param(32, 8, 128, 16, [512, 300, 77], [0, 0, 0], id="gqa4-d128-no-prefix"),
        pytest.param(32, 8, 64, 16, _qlens, _prefixes, id="gqa4-d64-mixed"),
        pytest.param(8, 8, 128, 16, _qlens, _prefixes, id="mha-d128-mixed"),
        pytest.param(32, 4, 128, 16, [1, 2048, 0, 33], [2047, 0, 64, 1000], id="gqa8-d128-edges"),
    ]
else:
    PREFILL_CASES = [
        pytest.param(2, 2, 16, 4, [5, 9, 1], [0, 0, 0], id="mha-no-prefix"),
        pytest.param(4, 2, 32, 8, [4, 7], [13, 8], id="gqa2-prefix"),
        pytest.param(8, 2, 16, 4, [1, 12, 0, 6, 3], [20, 0, 5, 9, 1], id="gqa4-mixed"),
        pytest.param(8, 2, 16, 4, [70], [3], id="gqa4-several-query-blocks"),
        # Key tiles wholly before a query block's first query take the unmasked path: several here.
        pytest.param(4, 2, 16, 4, [90, 2], [150, 260], id="gqa2-unmasked-tiles"),
    ]


@pytest.mark.parametrize("dtype", ATTENTION_DTYPES, ids=str)
@pytest.mark.parametrize("num_heads, num_kv_heads, head_size, block_size, query_lens, prefix_lens", PREFILL_CASES)
def test_prefill_attention_matches_reference(num_heads, num_kv_heads, head_size, block_size, query_lens,
                                             prefix_lens, dtype):
    _check_prefill(num_heads, num_kv_heads, head_size, block_size, query_lens, prefix_lens, dtype, dtype)


@pytest.mark.parametrize("dtype", FP8_QUERY_DTYPES, ids=str)
@pytest.mark.parametrize("num_heads, num_kv_heads, head_size, block_size, query_lens, prefix_lens",
                         PREFILL_CASES[1:3])
def test_prefill_attention_reads_an_fp8_cache(num_heads, num_kv_heads, head_size, block_size, query_lens,
                                              prefix_lens, dtype):
    _check_prefill(num_heads, num_kv_heads, head_size, block_size, query_lens, prefix_lens, dtype, FP8)


def _check_prefill(num_heads, num_kv_heads, head_size, block_size, query_lens, prefix_lens, dtype, cache_dtype):
    gen = generator(sum(query_lens) + (100 if cache_dtype != dtype else 0))
    seq_lens = [p + q for q, p in zip(query_lens, prefix_lens)]
    k_cache, v_cache, block_tables = paged_cache(seq_lens, num_kv_heads, block_size, head_size, cache_dtype, gen)
    q = randn(sum(query_lens), num_heads, head_size, gen=gen, dtype=dtype)
    query_start_loc = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32,
                                   device=DEVICE)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    scale = head_size**-0.5
    out = torch.full_like(q, float("nan"))

    got = prefill_attention(q, k_cache, v_cache, query_start_loc, lens, block_tables, scale, max(query_lens),
                            out=out)

    assert got is out
    ref = prefill_attention_ref(q, k_cache, v_cache, query_start_loc, lens, block_tables, scale)
    _assert_attention_close(out, ref, dtype)


@pytest.mark.parametrize("block_rows, block_n", [(16, 16), (32, 16), (16, 32)])
def test_prefill_attention_with_small_tiles(block_rows, block_n):
    """Small tiles give every query block several unmasked key tiles, then several masked ones (its own queries',
    over a context that ends inside a tile)."""
    gen = generator(block_rows + block_n)
    query_lens, prefix_lens = [40, 3, 17], [37, 50, 0]
    seq_lens = [p + q for q, p in zip(query_lens, prefix_lens)]
    k_cache, v_cache, block_tables = paged_cache(seq_lens, 2, 4, 16, torch.float32, gen)
    q = randn(sum(query_lens), 4, 16, gen=gen)
    query_start_loc = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32,
                                   device=DEVICE)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    out = torch.full_like(q, float("nan"))

    prefill_attention(q, k_cache, v_cache, query_start_loc, lens, block_tables, 0.25, max(query_lens), out=out,
                      block_rows=block_rows, block_n=block_n)

    ref = prefill_attention_ref(q, k_cache, v_cache, query_start_loc, lens, block_tables, 0.25)
    _assert_attention_close(out, ref, torch.float32)


def test_prefill_of_one_token_equals_decode():
    gen = generator(11)
    seq_lens = [1, 10, 27]
    k_cache, v_cache, block_tables = paged_cache(seq_lens, 2, 4, 16, torch.float32, gen)
    q = randn(3, 4, 16, gen=gen)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    query_start_loc = torch.arange(4, dtype=torch.int32, device=DEVICE)

    prefill = prefill_attention(q, k_cache, v_cache, query_start_loc, lens, block_tables, 0.3, 1)
    decode = decode_attention(q, k_cache, v_cache, block_tables, lens, 0.3, 2)

    torch.testing.assert_close(prefill, decode, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("num_splits", [1, 2])
def test_launch_cache_reuses_kernels_across_layers(num_splits):
    """As in a step's eager layers: one launch cache, a different KV cache per call. Every call must equal the
    reference for its own cache (on the GPU the later calls skip Triton's dispatch; the interpreter keeps none)."""
    gen = generator(31 + num_splits)
    seq_lens = [5, 40, 17] if not ON_GPU else [100, 1500, 700, 33]
    query_lens = [3, 1, 6] if not ON_GPU else [64, 1, 200, 7]
    heads, kv_heads, head_size, block_size = (4, 2, 16, 4) if not ON_GPU else (32, 8, 64, 16)
    dtype = torch.float32 if not ON_GPU else torch.bfloat16
    k_cache, v_cache, block_tables = paged_cache(seq_lens, kv_heads, block_size, head_size, dtype, gen)
    # Other layers' caches: other values, the same unowned (NaN) slots.
    layers = [(k_cache + i * randn(*k_cache.shape, gen=gen, dtype=dtype),
               v_cache - i * randn(*v_cache.shape, gen=gen, dtype=dtype)) for i in range(3)]
    q = randn(len(seq_lens), heads, head_size, gen=gen, dtype=dtype)
    q_prefill = randn(sum(query_lens), heads, head_size, gen=gen, dtype=dtype)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    query_start_loc = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32,
                                   device=DEVICE)
    scale = head_size**-0.5
    cache: dict = {}
    for k_cache, v_cache in layers:
        out = torch.full_like(q, float("nan"))
        decode_attention(q, k_cache, v_cache, block_tables, lens, scale, num_splits, out=out, launch_cache=cache)
        _assert_attention_close(out, decode_attention_ref(q, k_cache, v_cache, block_tables, lens, scale), dtype)
        out = torch.full_like(q_prefill, float("nan"))
        prefill_attention(q_prefill, k_cache, v_cache, query_start_loc, lens, block_tables, scale, max(query_lens),
                          out=out, launch_cache=cache)
        ref = prefill_attention_ref(q_prefill, k_cache, v_cache, query_start_loc, lens, block_tables, scale)
        _assert_attention_close(out, ref, dtype)
    if ON_GPU:
        assert len(cache) == (2 if num_splits == 1 else 3)


def test_references_agree_with_plain_softmax_attention():
    """Anchors the paged references themselves: one contiguous request equals textbook causal attention."""
    gen = generator(8)
    seq_len, heads, head_size = 10, 2, 16
    k_cache, v_cache, block_tables = paged_cache([seq_len], heads, 4, head_size, torch.float32, gen)
    q = randn(seq_len, heads, head_size, gen=gen)
    k = torch.cat([k_cache[:, b] for b in block_tables[0, :3].long()], dim=1)[:, :seq_len]
    v = torch.cat([v_cache[:, b] for b in block_tables[0, :3].long()], dim=1)[:, :seq_len]
    scores = torch.einsum("qhd,hkd->hqk", q, k) / math.sqrt(head_size)
    causal = torch.ones(seq_len, seq_len, dtype=torch.bool, device=DEVICE).tril()
    expected = torch.einsum("hqk,hkd->qhd", scores.masked_fill(~causal, float("-inf")).softmax(-1), v)

    ref = prefill_attention_ref(q, k_cache, v_cache, torch.tensor([0, seq_len], device=DEVICE),
                                torch.tensor([seq_len], device=DEVICE), block_tables, head_size**-0.5)

    torch.testing.assert_close(ref, expected)
