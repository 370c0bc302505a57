"""The Triton kernels equal their plain torch references (rtx_kernels.reference).

Without a GPU the kernels run under Triton's interpreter (conftest sets TRITON_INTERPRET=1) on small shapes; on a
CUDA machine the same tests run compiled, on serving-sized shapes. The attention tests poison every cache slot that
no request owns (the null block, spare blocks, the tail of each last block) and the output buffer with NaN, so a
missing mask or an unwritten element shows up as a NaN.

The interpreter cannot run ``tl.dot`` on bfloat16 (it multiplies the raw bit patterns; triton-lang/triton#11584,
closed as unsupported), so on the CPU the attention kernels are checked in fp32 and fp16 only; the elementwise
kernels are checked in bfloat16 everywhere.
"""

from __future__ import annotations

import math
import os

import pytest
import torch

pytest.importorskip("triton")

from rtx_kernels.activation import silu_and_mul  # noqa: E402
from rtx_kernels.decode_attention import (  # noqa: E402
    DecodeWorkspace,
    choose_num_splits,
    decode_attention,
)
from rtx_kernels.gemv import choose_split_k, gemv  # noqa: E402
from rtx_kernels.prefill_attention import prefill_attention  # noqa: E402
from rtx_kernels.reference import (  # noqa: E402
    apply_rotary_ref,
    decode_attention_ref,
    gemv_ref,
    prefill_attention_ref,
    rms_norm_ref,
    silu_and_mul_ref,
    write_kv_ref,
)
from rtx_kernels.rmsnorm import rms_norm  # noqa: E402
from rtx_kernels.rotary import apply_rotary  # noqa: E402

ON_GPU = os.environ.get("TRITON_INTERPRET") != "1"
if ON_GPU and not torch.cuda.is_available():
    pytest.skip("compiled Triton needs CUDA; set TRITON_INTERPRET=1 to use the interpreter", allow_module_level=True)
DEVICE = "cuda" if ON_GPU else "cpu"

ATTENTION_DTYPES = [torch.float32, torch.float16, torch.bfloat16] if ON_GPU else [torch.float32, torch.float16]
ALL_DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# (max abs error, relative Frobenius error) against a float32 reference.
ATTENTION_TOLERANCE = {torch.float32: (1e-4, 1e-5), torch.float16: (5e-3, 2e-3), torch.bfloat16: (2e-2, 1e-2)}


def _generator(seed: int) -> torch.Generator:
    return torch.Generator(device=DEVICE).manual_seed(seed)


def _randn(*shape, gen, dtype=torch.float32) -> torch.Tensor:
    return torch.randn(*shape, generator=gen, device=DEVICE).to(dtype)


def _paged_cache(seq_lens: list[int], num_kv_heads: int, block_size: int, head_size: int, dtype, gen):
    """Random K/V caches ``[KVH, blocks, bs, D]`` and int32 block tables with shuffled, out-of-order block ids.

    Slots no request owns hold NaN, block 0 (the null block) included, and tables are padded past their need.
    """
    needed = [-(-s // block_size) for s in seq_lens]
    num_blocks = 1 + sum(needed) + 3
    order = torch.randperm(num_blocks - 1, generator=gen, device=DEVICE) + 1
    max_blocks = max(needed, default=0) + 2
    block_tables = torch.zeros(len(seq_lens), max_blocks, dtype=torch.int32, device=DEVICE)
    owned = torch.zeros(num_blocks, block_size, dtype=torch.bool, device=DEVICE)
    used = 0
    for r, (seq_len, n) in enumerate(zip(seq_lens, needed)):
        ids = order[used : used + n]
        used += n
        block_tables[r, :n] = ids.int()
        owned[ids] = True
        if seq_len % block_size:
            owned[ids[-1], seq_len % block_size :] = False
    caches = []
    for _ in range(2):
        cache = _randn(num_kv_heads, num_blocks, block_size, head_size, gen=gen, dtype=dtype)
        cache[:, ~owned] = float("nan")
        caches.append(cache)
    return caches[0], caches[1], block_tables


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
    gen = _generator(len(seq_lens) + num_splits)
    k_cache, v_cache, block_tables = _paged_cache(seq_lens, num_kv_heads, block_size, head_size, dtype, gen)
    q = _randn(len(seq_lens), num_heads, head_size, gen=gen, dtype=dtype)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    scale = head_size**-0.5
    out = torch.full_like(q, float("nan"))

    got = decode_attention(q, k_cache, v_cache, block_tables, lens, scale, num_splits, out=out)

    assert got is out
    _assert_attention_close(out, decode_attention_ref(q, k_cache, v_cache, block_tables, lens, scale), dtype)
    assert (out[lens == 0] == 0).all()


def test_decode_attention_reuses_a_larger_workspace():
    gen = _generator(7)
    seq_lens, num_splits = [9, 0, 21], 4
    k_cache, v_cache, block_tables = _paged_cache(seq_lens, 2, 4, 16, torch.float32, gen)
    q = _randn(3, 4, 16, gen=gen)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    workspace = DecodeWorkspace.allocate(8, 4, 6, 16, DEVICE)
    workspace.partial_out.fill_(float("nan"))

    out = decode_attention(q, k_cache, v_cache, block_tables, lens, 0.25, num_splits, workspace=workspace)

    _assert_attention_close(out, decode_attention_ref(q, k_cache, v_cache, block_tables, lens, 0.25), torch.float32)


@pytest.mark.parametrize("batch, kv_heads, hint, expected", [
    (1, 8, 4096, 16), (1, 8, 300, 1), (4, 8, 2048, 8), (32, 8, 4096, 4), (64, 8, 4096, 2), (128, 8, 4096, 1),
    (256, 8, 128, 1), (1, 1, 1 << 20, 32)])
def test_choose_num_splits(batch, kv_heads, hint, expected):
    assert choose_num_splits(batch, kv_heads, hint) == expected


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
    ]


@pytest.mark.parametrize("dtype", ATTENTION_DTYPES, ids=str)
@pytest.mark.parametrize("num_heads, num_kv_heads, head_size, block_size, query_lens, prefix_lens", PREFILL_CASES)
def test_prefill_attention_matches_reference(num_heads, num_kv_heads, head_size, block_size, query_lens,
                                             prefix_lens, dtype):
    gen = _generator(sum(query_lens))
    seq_lens = [p + q for q, p in zip(query_lens, prefix_lens)]
    k_cache, v_cache, block_tables = _paged_cache(seq_lens, num_kv_heads, block_size, head_size, dtype, gen)
    q = _randn(sum(query_lens), num_heads, head_size, gen=gen, dtype=dtype)
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


def test_prefill_of_one_token_equals_decode():
    gen = _generator(11)
    seq_lens = [1, 10, 27]
    k_cache, v_cache, block_tables = _paged_cache(seq_lens, 2, 4, 16, torch.float32, gen)
    q = _randn(3, 4, 16, gen=gen)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    query_start_loc = torch.arange(4, dtype=torch.int32, device=DEVICE)

    prefill = prefill_attention(q, k_cache, v_cache, query_start_loc, lens, block_tables, 0.3, 1)
    decode = decode_attention(q, k_cache, v_cache, block_tables, lens, 0.3, 2)

    torch.testing.assert_close(prefill, decode, rtol=1e-5, atol=1e-5)


HIDDEN = 4096 if ON_GPU else 48
ROWS = 300 if ON_GPU else 5


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
@pytest.mark.parametrize("with_residual", [False, True], ids=["plain", "residual"])
def test_rms_norm_matches_model(dtype, with_residual):
    gen = _generator(3)
    x = _randn(ROWS, HIDDEN, gen=gen, dtype=dtype)
    residual = _randn(ROWS, HIDDEN, gen=gen, dtype=dtype) if with_residual else None
    weight = (1.0 + 0.1 * _randn(HIDDEN, gen=gen)).to(dtype)

    out, residual_out = rms_norm(x, weight, 1e-5, residual)

    ref_out, ref_residual = rms_norm_ref(x, weight, 1e-5, residual)
    if dtype == torch.bfloat16 and not ON_GPU:
        # The interpreter truncates fp32 -> bf16 where the GPU (and torch) round to nearest even.
        torch.testing.assert_close(residual_out, ref_residual, rtol=8e-3, atol=0)
    else:
        assert torch.equal(residual_out, ref_residual)
    assert out.dtype == ref_out.dtype
    # The row's sum of squares is reduced in a different order, which can move a rounding by one ulp.
    ulp = {torch.float32: 2e-6, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}[dtype]
    torch.testing.assert_close(out, ref_out, rtol=ulp, atol=ulp)


def test_rms_norm_promotes_like_torch():
    gen = _generator(4)
    x = _randn(3, HIDDEN, gen=gen, dtype=torch.bfloat16)
    weight = 1.0 + 0.1 * _randn(HIDDEN, gen=gen)

    out, _ = rms_norm(x, weight, 1e-6)

    ref, _ = rms_norm_ref(x, weight, 1e-6)
    assert out.dtype == torch.float32
    # The normalised row is rounded to bf16 before the weight multiplies it, so it may differ by one bf16 ulp.
    torch.testing.assert_close(out, ref, rtol=1.6e-2, atol=1.6e-2)


def _rope_tables(max_pos: int, head_size: int, base: float = 10000.0):
    inv_freq = 1.0 / base ** (torch.arange(0, head_size, 2, dtype=torch.float32, device=DEVICE) / head_size)
    angles = torch.arange(max_pos, dtype=torch.float32, device=DEVICE)[:, None] * inv_freq[None, :]
    return angles.cos(), angles.sin()


ROTARY_SHAPES = [(32, 8, 128), (9, 3, 64)] if ON_GPU else [(4, 2, 16), (9, 3, 64)]
ROTARY_TOLERANCE = {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 8e-3}


def _packed_qkv(num_tokens: int, num_heads: int, num_kv_heads: int, head_size: int, dtype, gen):
    """Strided q, k, v views of a random packed projection ``[T, (H + 2 * KVH) * D]``."""
    qkv = _randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_size, gen=gen, dtype=dtype)
    q_size, kv_size = num_heads * head_size, num_kv_heads * head_size
    q = qkv[:, :q_size].view(num_tokens, num_heads, head_size)
    k = qkv[:, q_size : q_size + kv_size].view(num_tokens, num_kv_heads, head_size)
    v = qkv[:, q_size + kv_size :].view(num_tokens, num_kv_heads, head_size)
    assert not q.is_contiguous() and not k.is_contiguous() and not v.is_contiguous()
    return q, k, v


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
@pytest.mark.parametrize("num_heads, num_kv_heads, head_size", ROTARY_SHAPES)
def test_rotary_on_packed_qkv_views(dtype, num_heads, num_kv_heads, head_size):
    gen = _generator(5)
    num_tokens, max_pos = (37, 4096) if ON_GPU else (6, 64)
    q, k, v = _packed_qkv(num_tokens, num_heads, num_kv_heads, head_size, dtype, gen)
    positions = torch.randint(0, max_pos, (num_tokens,), generator=gen, device=DEVICE)
    cos, sin = _rope_tables(max_pos, head_size)
    v_before = v.clone()
    ref_q, ref_k = apply_rotary_ref(q.clone(), k.clone(), positions, cos, sin)

    got_q, got_k = apply_rotary(q, k, positions, cos, sin)

    assert got_q is q and got_k is k
    tol = ROTARY_TOLERANCE[dtype]
    torch.testing.assert_close(q, ref_q, rtol=tol, atol=tol)
    torch.testing.assert_close(k, ref_k, rtol=tol, atol=tol)
    assert torch.equal(v, v_before), "v must be left alone"


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
@pytest.mark.parametrize("num_heads, num_kv_heads, head_size", ROTARY_SHAPES)
def test_rotary_writes_rotated_k_and_v_into_paged_cache(dtype, num_heads, num_kv_heads, head_size):
    gen = _generator(9)
    num_tokens, max_pos, block_size = (37, 4096, 16) if ON_GPU else (6, 64, 4)
    num_padding = 3  # CUDA-graph padding rows, all pointed at the null block's slot 0
    q, k, v = _packed_qkv(num_tokens + num_padding, num_heads, num_kv_heads, head_size, dtype, gen)
    positions = torch.randint(0, max_pos, (num_tokens + num_padding,), generator=gen, device=DEVICE)
    cos, sin = _rope_tables(max_pos, head_size)
    num_blocks = 1 + -(-num_tokens // block_size) + 2
    # Distinct, shuffled slots anywhere past the null block, so most slots of every block stay unwritten.
    slots = torch.randperm((num_blocks - 1) * block_size, generator=gen, device=DEVICE)[:num_tokens] + block_size
    slot_mapping = torch.cat([slots, torch.zeros(num_padding, dtype=torch.int64, device=DEVICE)])
    k_cache = _randn(num_kv_heads, num_blocks, block_size, head_size, gen=gen, dtype=dtype)
    v_cache = _randn(num_kv_heads, num_blocks, block_size, head_size, gen=gen, dtype=dtype)
    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    v_before = v.clone()
    ref_q, ref_k = apply_rotary_ref(q.clone(), k.clone(), positions, cos, sin)

    got_q, got_k = apply_rotary(q, k, positions, cos, sin, v, k_cache, v_cache, slot_mapping)

    assert got_q is q and got_k is k
    tol = ROTARY_TOLERANCE[dtype]
    torch.testing.assert_close(q, ref_q, rtol=tol, atol=tol)
    torch.testing.assert_close(k, ref_k, rtol=tol, atol=tol)
    assert torch.equal(v, v_before), "v must be left alone"
    # The cache must hold bit for bit the k left in place (what attention over this chunk reads).
    write_kv_ref(k[:num_tokens], v[:num_tokens], expected_k, expected_v, slots)
    not_null = torch.arange(num_blocks * block_size, device=DEVICE) > 0
    for name, cache, expected, src in (("k", k_cache, expected_k, k), ("v", v_cache, expected_v, v)):
        flat = cache.view(num_kv_heads, -1, head_size)
        assert torch.equal(flat[:, not_null], expected.view(num_kv_heads, -1, head_size)[:, not_null]), name
        # The padding rows race for slot 0: each element is one of theirs.
        padding = src[num_tokens:].transpose(0, 1)  # [KVH, P, D]
        assert (flat[:, :1] == padding).any(dim=1).all(), name


def test_rotary_cache_arguments_go_together():
    gen = _generator(10)
    q, k, v = _packed_qkv(2, 4, 2, 16, torch.float32, gen)
    cos, sin = _rope_tables(8, 16)
    cache = torch.zeros(2, 2, 4, 16, device=DEVICE)
    positions = torch.zeros(2, dtype=torch.int64, device=DEVICE)

    with pytest.raises(ValueError, match="go together"):
        apply_rotary(q, k, positions, cos, sin, v=v, k_cache=cache, v_cache=cache)
    with pytest.raises(ValueError, match="share a dtype"):
        apply_rotary(q, k, positions, cos, sin, v, cache.half(), cache.half(), positions)


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
def test_silu_and_mul_on_strided_rows(dtype):
    gen = _generator(6)
    num_tokens, ffn = (50, 14336) if ON_GPU else (4, 40)
    wide = _randn(num_tokens, 2 * ffn + 8, gen=gen, dtype=dtype)
    x = wide[:, : 2 * ffn]

    out = silu_and_mul(x)

    tol = {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 8e-3}[dtype]
    torch.testing.assert_close(out, silu_and_mul_ref(x), rtol=tol, atol=tol)
    assert out.shape == (num_tokens, ffn) and out.is_contiguous()


def test_references_agree_with_plain_softmax_attention():
    """Anchors the paged references themselves: one contiguous request equals textbook causal attention."""
    gen = _generator(8)
    seq_len, heads, head_size = 10, 2, 16
    k_cache, v_cache, block_tables = _paged_cache([seq_len], heads, 4, head_size, torch.float32, gen)
    q = _randn(seq_len, heads, head_size, gen=gen)
    k = torch.cat([k_cache[:, b] for b in block_tables[0, :3].long()], dim=1)[:, :seq_len]
    v = torch.cat([v_cache[:, b] for b in block_tables[0, :3].long()], dim=1)[:, :seq_len]
    scores = torch.einsum("qhd,hkd->hqk", q, k) / math.sqrt(head_size)
    causal = torch.ones(seq_len, seq_len, dtype=torch.bool, device=DEVICE).tril()
    expected = torch.einsum("hqk,hkd->qhd", scores.masked_fill(~causal, float("-inf")).softmax(-1), v)

    ref = prefill_attention_ref(q, k_cache, v_cache, torch.tensor([0, seq_len], device=DEVICE),
                                torch.tensor([seq_len], device=DEVICE), block_tables, head_size**-0.5)

    torch.testing.assert_close(ref, expected)


# (N, K) of the decode-time projections of Llama-3.2-1B (qkv, o_proj, gate_up, down_proj, LM head) on the GPU; on
# the CPU, N and K straddle the interpreter's 32 x 32 tile so every mask is exercised.
GEMV_SHAPES = [(3072, 2048), (2048, 2048), (16384, 2048), (2048, 8192), (128256, 2048)] if ON_GPU else [(37, 83)]
GEMV_ROWS = [1, 2, 4] if ON_GPU else [1, 2, 3, 4, 8]
GEMV_DTYPES = [torch.bfloat16] if ON_GPU else [torch.float32, torch.bfloat16]
# Relative Frobenius error against the fp32 reference: fp32 is near-exact, 16-bit outputs are one rounding off.
GEMV_TOLERANCE = {torch.float32: 1e-4, torch.float16: 2e-3, torch.bfloat16: 1e-2}


def _gemv_inputs(m: int, n: int, k: int, dtype, with_bias: bool, seed: int, pad: int = 16):
    gen = _generator(seed)
    # x's rows are a slice of wider rows (stride(0) = K + pad), as when x is a view into a packed activation. A pad
    # of 16 keeps the GPU's 16-element alignment of the rows (the fast path); an odd one loses it.
    x = _randn(m, k + pad, gen=gen, dtype=dtype)[:, :k]
    weight = (_randn(n, k, gen=gen) / math.sqrt(k)).to(dtype)
    bias = _randn(n, gen=gen, dtype=dtype) if with_bias else None
    return x, weight, bias


def _check_gemv(m: int, n: int, k: int, dtype, with_bias: bool, split_k: int | None = None, seed: int = 0,
                pad: int = 16):
    x, weight, bias = _gemv_inputs(m, n, k, dtype, with_bias, seed, pad)
    assert x.stride(0) != k and x.stride(1) == 1
    # NaN rows around out: the kernel must write all of its [m, n] view and nothing else.
    buffer = torch.full((m + 2, n), float("nan"), dtype=dtype, device=DEVICE)
    out = buffer[1 : m + 1]

    got = gemv(x, weight, bias, out=out, split_k=split_k)

    assert got is out
    assert buffer[0].isnan().all() and buffer[-1].isnan().all()
    _assert_gemv_close(out, gemv_ref(x, weight, bias))


def _assert_gemv_close(out: torch.Tensor, ref: torch.Tensor) -> None:
    assert out.dtype == ref.dtype
    assert torch.isfinite(out).all(), "an output element was not written"
    rel_err = ((out.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-12)).item()
    assert rel_err <= GEMV_TOLERANCE[out.dtype], f"relative error {rel_err:.2e}"


@pytest.mark.parametrize("dtype", GEMV_DTYPES, ids=str)
@pytest.mark.parametrize("with_bias", [False, True], ids=["plain", "bias"])
@pytest.mark.parametrize("m", GEMV_ROWS)
@pytest.mark.parametrize("n, k", GEMV_SHAPES)
def test_gemv_matches_reference(n, k, m, with_bias, dtype):
    _check_gemv(m, n, k, dtype, with_bias, seed=m + n + k)


# (N, K, split_k, dtype). On the CPU: whole tiles per split (the unmasked path), ragged splits, and 40 columns in 4
# splits of 32, the last two empty; on the GPU, down_proj at every split and the other dtypes.
if ON_GPU:
    GEMV_SPLIT_CASES = [(2048, 8192, s, torch.bfloat16) for s in (1, 2, 4, 8)] + [
        (2048, 8192, None, torch.float32), (2048, 8192, None, torch.float16), (3072, 2048, None, torch.float32)]
else:
    GEMV_SPLIT_CASES = [(29, 64, 2, torch.float32), (37, 83, 3, torch.float32), (6, 40, 4, torch.float16)]


@pytest.mark.parametrize("m", [1, 3])
@pytest.mark.parametrize("n, k, split_k, dtype", GEMV_SPLIT_CASES, ids=str)
def test_gemv_split_k_and_dtypes(n, k, split_k, dtype, m):
    _check_gemv(m, n, k, dtype, with_bias=m > 1, split_k=split_k, seed=n + m, pad=5)


def test_gemv_is_deterministic():
    n, k = (2048, 8192) if ON_GPU else (37, 83)
    x, weight, bias = _gemv_inputs(2, n, k, torch.bfloat16, True, seed=12)

    first = gemv(x, weight, bias, split_k=3)

    assert torch.equal(gemv(x, weight, bias, split_k=3), first)


@pytest.mark.skipif(not ON_GPU, reason="CUDA graphs need a GPU")
def test_gemv_replays_in_a_cuda_graph():
    x, weight, bias = _gemv_inputs(2, 2048, 8192, torch.bfloat16, True, seed=13)
    out = torch.empty(2, 2048, dtype=torch.bfloat16, device=DEVICE)
    gemv(x, weight, bias, out=out)  # autotunes outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        gemv(x, weight, bias, out=out)

    x.copy_(torch.randn_like(x))
    out.fill_(float("nan"))
    graph.replay()

    _assert_gemv_close(out, gemv_ref(x, weight, bias))


@pytest.mark.parametrize("n, k, expected", [(2048, 8192, 1), (2048, 2048, 1), (3072, 2048, 1), (16384, 2048, 1),
                                            (128256, 2048, 1), (512, 32768, 2), (256, 16384, 4), (64, 65536, 8),
                                            (256, 4096, 2), (2048, 4096, 1)])
def test_choose_split_k(n, k, expected):
    assert choose_split_k(n, k) == expected
