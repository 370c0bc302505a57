"""The fused elementwise Triton kernels (RMSNorm with residual, rotary embedding with the K/V store, SiLU-and-mul)
equal the model's torch ops; they are checked in bfloat16 under the interpreter too. Their fp8 variants equal the
plain kernel followed by the activations' quantization, byte for byte."""

from __future__ import annotations

import pytest
import torch

from rtx_kernels.activation import silu_and_mul, silu_and_mul_fp8
from rtx_kernels.quant_rows import quantize_rows_fp8
from rtx_kernels.reference import (
    apply_rotary_ref,
    rms_norm_ref,
    silu_and_mul_ref,
    write_kv_ref,
)
from rtx_kernels.rmsnorm import rms_norm, rms_norm_fp8
from rtx_kernels.rotary import apply_rotary
from tests.helpers.triton import ALL_DTYPES, DEVICE, ON_GPU, generator, randn

FP8 = torch.float8_e4m3fn

HIDDEN = 4096 if ON_GPU else 48
ROWS = 300 if ON_GPU else 5


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
@pytest.mark.parametrize("with_residual", [False, True], ids=["plain", "residual"])
def test_rms_norm_matches_model(dtype, with_residual):
    gen = generator(3)
    x = randn(ROWS, HIDDEN, gen=gen, dtype=dtype)
    residual = randn(ROWS, HIDDEN, gen=gen, dtype=dtype) if with_residual else None
    weight = (1.0 + 0.1 * randn(HIDDEN, gen=gen)).to(dtype)

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
    gen = generator(4)
    x = randn(3, HIDDEN, gen=gen, dtype=torch.bfloat16)
    weight = 1.0 + 0.1 * randn(HIDDEN, gen=gen)

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
    qkv = randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_size, gen=gen, dtype=dtype)
    q_size, kv_size = num_heads * head_size, num_kv_heads * head_size
    q = qkv[:, :q_size].view(num_tokens, num_heads, head_size)
    k = qkv[:, q_size : q_size + kv_size].view(num_tokens, num_kv_heads, head_size)
    v = qkv[:, q_size + kv_size :].view(num_tokens, num_kv_heads, head_size)
    assert not q.is_contiguous() and not k.is_contiguous() and not v.is_contiguous()
    return q, k, v


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
@pytest.mark.parametrize("num_heads, num_kv_heads, head_size", ROTARY_SHAPES)
def test_rotary_on_packed_qkv_views(dtype, num_heads, num_kv_heads, head_size):
    gen = generator(5)
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
def test_rotary_writes_rotated_k_and_v_intopaged_cache(dtype, num_heads, num_kv_heads, head_size):
    gen = generator(9)
    num_tokens, max_pos, block_size = (37, 4096, 16) if ON_GPU else (6, 64, 4)
    num_padding = 3  # CUDA-graph padding rows, all pointed at the null block's slot 0
    q, k, v = _packed_qkv(num_tokens + num_padding, num_heads, num_kv_heads, head_size, dtype, gen)
    positions = torch.randint(0, max_pos, (num_tokens + num_padding,), generator=gen, device=DEVICE)
    cos, sin = _rope_tables(max_pos, head_size)
    num_blocks = 1 + -(-num_tokens // block_size) + 2
    # Distinct, shuffled slots anywhere past the null block, so most slots of every block stay unwritten.
    slots = torch.randperm((num_blocks - 1) * block_size, generator=gen, device=DEVICE)[:num_tokens] + block_size
    slot_mapping = torch.cat([slots, torch.zeros(num_padding, dtype=torch.int64, device=DEVICE)])
    k_cache = randn(num_kv_heads, num_blocks, block_size, head_size, gen=gen, dtype=dtype)
    v_cache = randn(num_kv_heads, num_blocks, block_size, head_size, gen=gen, dtype=dtype)
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


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
def test_rotary_stores_k_and_v_in_an_fp8_cache(dtype):
    """An fp8 cache gets the rotated k rounded once from fp32 (and v from its dtype), saturated at +-448."""
    gen = generator(11)
    num_heads, num_kv_heads, head_size = ROTARY_SHAPES[0]
    num_tokens, max_pos, block_size = (37, 4096, 16) if ON_GPU else (6, 64, 4)
    q, k, v = _packed_qkv(num_tokens, num_heads, num_kv_heads, head_size, dtype, gen)
    v[0, 0, :4] = torch.tensor([1000.0, -1000.0, 448.0, -500.0], dtype=dtype)  # past the e4m3 range
    positions = torch.randint(0, max_pos, (num_tokens,), generator=gen, device=DEVICE)
    cos, sin = _rope_tables(max_pos, head_size)
    num_blocks = 1 + -(-num_tokens // block_size)
    slots = torch.randperm((num_blocks - 1) * block_size, generator=gen, device=DEVICE)[:num_tokens] + block_size
    k_cache = torch.zeros(num_kv_heads, num_blocks, block_size, head_size, dtype=FP8, device=DEVICE)
    v_cache = torch.zeros_like(k_cache)
    _, rotated_k = apply_rotary_ref(q.float(), k.float(), positions, cos, sin)
    expected = [x.clamp(-448, 448).to(FP8).transpose(0, 1) for x in (rotated_k, v.float())]

    apply_rotary(q, k, positions, cos, sin, v, k_cache, v_cache, slot_mapping=slots)

    for name, cache, want in (("k", k_cache, expected[0]), ("v", v_cache, expected[1])):
        got = cache.view(torch.uint8).view(num_kv_heads, -1, head_size)[:, slots].view(FP8).float()
        want = want.float()
        # The rotation's fp32 result may differ from torch's in its last bit (fused multiply-adds on the GPU),
        # which can move a value across an fp8 rounding boundary: one fp8 step (1/8 relative) at most, rarely.
        torch.testing.assert_close(got, want, rtol=0.13, atol=2**-9, msg=name)
        assert (got == want).float().mean() > 0.98, name
    stored_v = v_cache.view(torch.uint8).view(num_kv_heads, -1, head_size)[0, slots[0], :4].view(FP8)
    assert stored_v.float().tolist() == [448, -448, 448, -448]


def test_rotary_cache_arguments_go_together():
    gen = generator(10)
    q, k, v = _packed_qkv(2, 4, 2, 16, torch.float32, gen)
    cos, sin = _rope_tables(8, 16)
    cache = torch.zeros(2, 2, 4, 16, device=DEVICE)
    positions = torch.zeros(2, dtype=torch.int64, device=DEVICE)

    with pytest.raises(ValueError, match="go together"):
        apply_rotary(q, k, positions, cos, sin, v=v, k_cache=cache, v_cache=cache)
    with pytest.raises(ValueError, match="cannot be stored"):
        apply_rotary(q, k, positions, cos, sin, v, cache.half(), cache.half(), positions)


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
def test_silu_and_mul_on_strided_rows(dtype):
    gen = generator(6)
    num_tokens, ffn = (50, 14336) if ON_GPU else (4, 40)
    wide = randn(num_tokens, 2 * ffn + 8, gen=gen, dtype=dtype)
    x = wide[:, : 2 * ffn]

    out = silu_and_mul(x)

    tol = {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 8e-3}[dtype]
    torch.testing.assert_close(out, silu_and_mul_ref(x), rtol=tol, atol=tol)
    assert out.shape == (num_tokens, ffn) and out.is_contiguous()


def _assert_same_fp8(fused: tuple[torch.Tensor, torch.Tensor], x: torch.Tensor) -> None:
    """``fused`` (q, scale) are the bytes and scales ``quantize_rows_fp8`` makes of ``x``."""
    q, scale = fused
    q_ref, scale_ref = quantize_rows_fp8(x)
    assert q.dtype == FP8 and q.shape == x.shape and scale.shape == (x.shape[0], 1)
    assert torch.equal(scale, scale_ref)
    diff = (q.view(torch.uint8) != q_ref.view(torch.uint8)).nonzero()
    assert diff.numel() == 0, f"{len(diff)} values differ, first at {diff[0].tolist()}"


# 16-bit rows only: their squares are exact in float32, so the row's sum is the same whether or not the compiler
# fuses a multiply into an add; float32 rows' sums may differ by an ulp between the two kernels (seen on an H100), and
# the layers fuse only 16-bit rows (RMSNorm.forward).
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("with_residual", [False, True], ids=["plain", "residual"])
def test_rms_norm_fp8_is_rms_norm_then_quantized(dtype, with_residual):
    gen = generator(7)
    x = randn(ROWS, HIDDEN, gen=gen, dtype=dtype) * 3
    x[1] = 0  # a row of zeros: the smallest scale
    residual = randn(ROWS, HIDDEN, gen=gen, dtype=dtype) if with_residual else None
    weight = (1.0 + 0.5 * randn(HIDDEN, gen=gen)).to(dtype)

    q, scale, residual_out = rms_norm_fp8(x, weight, 1e-5, residual)

    out, ref_residual = rms_norm(x, weight, 1e-5, residual)
    assert torch.equal(residual_out, ref_residual)
    _assert_same_fp8((q, scale), out)


def test_rms_norm_fp8_rounds_to_the_promoted_dtype_first():
    """A float32 weight over bfloat16 rows: the unfused kernel stores float32, so nothing is rounded to bf16."""
    gen = generator(8)
    x = randn(3, HIDDEN, gen=gen, dtype=torch.bfloat16)
    weight = 1.0 + 0.1 * randn(HIDDEN, gen=gen)

    q, scale, _ = rms_norm_fp8(x, weight, 1e-6)

    out, _ = rms_norm(x, weight, 1e-6)
    assert out.dtype == torch.float32
    _assert_same_fp8((q, scale), out)


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
def test_silu_and_mul_fp8_is_silu_and_mul_then_quantized(dtype):
    gen = generator(9)
    num_tokens, ffn = (50, 14336) if ON_GPU else (4, 40)
    wide = randn(num_tokens, 2 * ffn + 8, gen=gen, dtype=dtype) * 4
    x = wide[:, : 2 * ffn]
    x[2] = 0

    _assert_same_fp8(silu_and_mul_fp8(x), silu_and_mul(x))


def test_silu_and_mul_fp8_past_one_program_a_row():
    """Rows wider than one program holds (16,384 columns) take the two kernels, with the same result."""
    gen = generator(10)
    x = randn(2, 2 * 16400, gen=gen, dtype=torch.bfloat16)

    _assert_same_fp8(silu_and_mul_fp8(x), silu_and_mul(x))


@pytest.mark.parametrize("fmt", ["rms_norm", "silu"])
def test_fp8_variants_give_a_row_holding_nan_a_nan_scale(fmt):
    gen = generator(11)
    x = randn(3, 2 * HIDDEN if fmt == "silu" else HIDDEN, gen=gen)
    x[1, 5] = float("nan")
    if fmt == "silu":
        q, scale = silu_and_mul_fp8(x)
    else:
        q, scale, _ = rms_norm_fp8(x, torch.ones(HIDDEN, device=DEVICE), 1e-5)
    assert scale[1].isnan().all() and not scale[[0, 2]].isnan().any()


def test_rms_norm_fp8_refuses_dtypes_that_promote_to_a_third():
    """float16 rows and a bfloat16 weight promote to float32, which the kernel would not round to: refused."""
    x = randn(2, HIDDEN, gen=generator(12), dtype=torch.float16)
    with pytest.raises(ValueError, match="third dtype"):
        rms_norm_fp8(x, torch.ones(HIDDEN, device=DEVICE, dtype=torch.bfloat16), 1e-5)
