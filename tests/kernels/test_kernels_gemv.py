"""The Triton GEMV kernel (decode-time projections) equals an fp32 matmul, split or not, eager or in a CUDA graph."""

from __future__ import annotations

import math

import pytest
import torch

from rtx_kernels.gemv import choose_split_k, gemv
from rtx_kernels.reference import gemv_ref
from tests.helpers.triton import DEVICE, ON_GPU, generator, randn

# (N, K) of the decode-time projections of Llama-3.2-1B (qkv, o_proj, gate_up, down_proj, LM head) on the GPU; on
# the CPU, N and K straddle the interpreter's 32 x 32 tile so every mask is exercised.
GEMV_SHAPES = [(3072, 2048), (2048, 2048), (16384, 2048), (2048, 8192), (128256, 2048)] if ON_GPU else [(37, 83)]
GEMV_ROWS = [1, 2, 4] if ON_GPU else [1, 2, 3, 4, 8]
GEMV_DTYPES = [torch.bfloat16] if ON_GPU else [torch.float32, torch.bfloat16]
# Relative Frobenius error against the fp32 reference: fp32 is near-exact, 16-bit outputs are one rounding off.
GEMV_TOLERANCE = {torch.float32: 1e-4, torch.float16: 2e-3, torch.bfloat16: 1e-2}


def _gemv_inputs(m: int, n: int, k: int, dtype, with_bias: bool, seed: int, pad: int = 16):
    gen = generator(seed)
    # x's rows are a slice of wider rows (stride(0) = K + pad), as when x is a view into a packed activation. A pad
    # of 16 keeps the GPU's 16-element alignment of the rows (the fast path); an odd one loses it.
    x = randn(m, k + pad, gen=gen, dtype=dtype)[:, :k]
    weight = (randn(n, k, gen=gen) / math.sqrt(k)).to(dtype)
    bias = randn(n, gen=gen, dtype=dtype) if with_bias else None
    return x, weight, bias


def _check_gemv(m: int, n: int, k: int, dtype, with_bias: bool, split_k: int | None = None, seed: int = 0,
                pad: int = 16, pdl: bool | None = None):
    x, weight, bias = _gemv_inputs(m, n, k, dtype, with_bias, seed, pad)
    assert x.stride(0) != k and x.stride(1) == 1
    # NaN rows around out: the kernel must write all of its [m, n] view and nothing else.
    buffer = torch.full((m + 2, n), float("nan"), dtype=dtype, device=DEVICE)
    out = buffer[1 : m + 1]

    got = gemv(x, weight, bias, out=out, split_k=split_k, pdl=pdl)

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


# The variant that loads its first weight tile before waiting for the previous kernel (programmatic dependent
# launch on the GPU; on the CPU the same code without the wait), and the one that does not, split or not.
@pytest.mark.parametrize("pdl", [True, False], ids=["prefetch", "plain"])
@pytest.mark.parametrize("m, split_k", [(1, 1), (3, 2), (1, None)])
def test_gemv_first_tile_prefetch(pdl, m, split_k):
    n, k = (3072, 2048) if ON_GPU else (37, 83)
    _check_gemv(m, n, k, torch.bfloat16, with_bias=m > 1, split_k=split_k, seed=7 + m, pad=5, pdl=pdl)


@pytest.mark.skipif(not ON_GPU, reason="CUDA graphs need a GPU")
def test_gemv_chain_with_programmatic_launch_in_a_cuda_graph():
    """Each GEMV reads the one before it: the prefetch before the wait must never see a stale input."""
    gen = generator(21)
    weights = [(randn(2048, 2048, gen=gen) / 45.0).to(torch.bfloat16) for _ in range(6)]
    x = randn(1, 2048, gen=gen, dtype=torch.bfloat16)
    outs = [torch.empty(1, 2048, dtype=torch.bfloat16, device=DEVICE) for _ in weights]

    def chain():
        h = x
        for w, o in zip(weights, outs):
            h = gemv(h, w, out=o)

    chain()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        chain()
    for _ in range(3):
        x.copy_(randn(1, 2048, gen=gen, dtype=torch.bfloat16))
        for o in outs:
            o.fill_(float("nan"))
        graph.replay()
        h = x
        for w, o in zip(weights, outs):
            ref = gemv_ref(h, w, None)
            _assert_gemv_close(o, ref)
            h = o


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


# fp8 e4m3 weights with one scale per row (the fp8 quantizer's decode path): the product of the dequantized weight.
@pytest.mark.parametrize("m, split_k", [(1, 1), (3, 2), (8, None)])
def test_gemv_fp8_weight_with_row_scales(m, split_k):
    n, k = (3072, 2048) if ON_GPU else (37, 83)
    x, weight, bias = _gemv_inputs(m, n, k, torch.bfloat16 if ON_GPU else torch.float32, True, seed=m, pad=5)
    scale = weight.float().abs().amax(dim=1).clamp_min(1e-12) / 448
    fp8 = (weight.float() / scale[:, None]).to(torch.float8_e4m3fn)
    got = gemv(x, fp8, bias, split_k=split_k, weight_scale=scale)
    _assert_gemv_close(got, gemv_ref(x, (fp8.float() * scale[:, None]).to(x.dtype), bias))
    with pytest.raises(ValueError, match="weight_scale"):
        gemv(x, fp8, bias, weight_scale=scale[:-1])
