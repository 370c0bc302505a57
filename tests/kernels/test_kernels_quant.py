"""Weight-only int8 / int4 linear layers equal a dequantize-then-fp32 matmul: the packing, the CPU paths and the
Triton kernels (GEMV for M <= 8, GEMM above), split or not, eager or in a CUDA graph.

The interpreter cannot run ``tl.dot`` on bfloat16 (test_kernels_attention.py says why), so on the CPU the GEMM
kernel is checked in fp32 and fp16 only.
"""

from __future__ import annotations

import math

import pytest
import torch

from rtx_kernels.quant_fma_gemv import choose_split_k
from rtx_kernels.quant_matmul import (
    DEQUANTIZE_MIN_M,
    _choose_kernel,
    int4_linear,
    int8_linear,
)
from rtx_kernels.quant_reference import (
    dequantize_int4,
    dequantize_int8,
    int4_linear_cpu,
    int8_linear_cpu,
    pack_int4,
    unpack_int4,
)
from rtx_kernels.reference import gemv_ref
from tests.helpers.triton import DEVICE, ON_GPU, generator

# Relative Frobenius error against the fp32 reference: fp32 is near-exact, 16-bit outputs are one rounding off.
TOLERANCE = {torch.float32: 1e-4, torch.float16: 2e-3, torch.bfloat16: 1e-2}


def _int8_weights(n: int, k: int, gen: torch.Generator, device=DEVICE):
    weight = torch.randint(-128, 128, (n, k), generator=gen, device=device).to(torch.int8)
    scale = torch.rand(n, generator=gen, device=device) / (64 * math.sqrt(k)) + 1e-4
    return weight, scale


def _int4_weights(n: int, k: int, group: int, gen: torch.Generator, device=DEVICE):
    q = torch.randint(0, 16, (n, k), generator=gen, device=device).to(torch.uint8)
    scale = torch.rand(n, k // group, generator=gen, device=device) / (8 * math.sqrt(k)) + 1e-4
    zero = torch.randint(0, 16, (n, k // group), generator=gen, device=device).to(torch.uint8)
    return pack_int4(q), scale, zero


def _x(m: int, k: int, dtype, gen: torch.Generator, pad: int = 16, device=DEVICE) -> torch.Tensor:
    # x's rows are a slice of wider rows (stride(0) = K + pad), as when x is a view into a packed activation.
    return torch.randn(m, k + pad, generator=gen, device=device).to(dtype)[:, :k]


def _bias(n: int, dtype, gen: torch.Generator, with_bias: bool, device=DEVICE):
    return torch.randn(n, generator=gen, device=device).to(dtype) if with_bias else None


def _assert_close(out: torch.Tensor, ref: torch.Tensor) -> None:
    assert out.dtype == ref.dtype and out.shape == ref.shape
    assert torch.isfinite(out).all(), "an output element was not written"
    rel_err = ((out.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-12)).item()
    assert rel_err <= TOLERANCE[out.dtype], f"relative error {rel_err:.2e}"


# --- the formats ---------------------------------------------------------------------------------------------------

def test_pack_int4_puts_column_8i_plus_j_in_bits_4j_of_word_i():
    q = torch.tensor([[1, 2, 3, 4, 5, 6, 7, 8, 15, 0, 0, 0, 0, 0, 0, 9]], dtype=torch.uint8)

    packed = pack_int4(q)

    assert packed.dtype == torch.int32 and packed.shape == (1, 2)
    assert packed[0, 0].item() == 0x87654321 - 2**32  # the top nibble sets the sign bit
    assert packed[0, 1].item() == 0x9000000F - 2**32
    assert torch.equal(unpack_int4(packed, 16), q)


def test_pack_and_unpack_round_trip():
    gen = torch.Generator().manual_seed(0)
    q = torch.randint(0, 16, (7, 64), generator=gen).to(torch.uint8)
    words = torch.randint(-2**31, 2**31, (7, 8), generator=gen, dtype=torch.int32)

    assert torch.equal(unpack_int4(pack_int4(q), 64), q)
    assert torch.equal(pack_int4(unpack_int4(words, 64)), words)


def test_dequantize_follows_the_definitions():
    gen = torch.Generator().manual_seed(1)
    packed, scale, zero = _int4_weights(3, 32, 8, gen, device="cpu")
    q = unpack_int4(packed, 32)
    expected = torch.tensor([[(q[n, k].item() - zero[n, k // 8].item()) * scale[n, k // 8].item() for k in range(32)]
                             for n in range(3)])
    weight, scale8 = _int8_weights(3, 32, gen, device="cpu")

    torch.testing.assert_close(dequantize_int4(packed, scale, zero, 8), expected)
    torch.testing.assert_close(dequantize_int8(weight, scale8, torch.float64),
                               torch.tensor([[weight[n, k].item() * scale8[n].item() for k in range(32)]
                                             for n in range(3)], dtype=torch.float64))


# --- the CPU paths -------------------------------------------------------------------------------------------------

# K = 64 takes aten's fused bf16 int8 kernel, K = 40 (not a multiple of 16) the dequantizing path.
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("m, k, with_bias", [(1, 64, False), (5, 64, True), (3, 40, True)])
def test_cpu_linear_paths(m, k, with_bias, dtype):
    gen = torch.Generator().manual_seed(m + k)
    x = _x(m, k, dtype, gen, pad=3, device="cpu")
    bias = _bias(19, dtype, gen, with_bias, device="cpu")
    weight, scale = _int8_weights(19, k, gen, device="cpu")
    packed, scale4, zero = _int4_weights(19, k, 8, gen, device="cpu")

    _assert_close(int8_linear_cpu(x, weight, scale, bias), gemv_ref(x, dequantize_int8(weight, scale), bias))
    _assert_close(int4_linear_cpu(x, packed, scale4, zero, 8, bias),
                  gemv_ref(x, dequantize_int4(packed, scale4, zero, 8), bias))


def test_cpu_int8_path_with_a_misaligned_contiguous_x():
    """aten's kernel needs aligned rows: a contiguous view at an odd offset must be copied, not read as is."""
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(4 * 64 + 1, generator=gen).to(torch.bfloat16)[1:].view(4, 64)
    weight, scale = _int8_weights(16, 64, gen, device="cpu")
    assert x.is_contiguous() and x.data_ptr() % 16

    _assert_close(int8_linear_cpu(x, weight, scale), gemv_ref(x, dequantize_int8(weight, scale)))


# --- the Triton kernels --------------------------------------------------------------------------------------------

# (N, K) of Llama-3.1-8B's projections (qkv, o_proj, gate_up, down_proj, LM head) on the GPU; on the CPU, odd N and
# K whose words straddle the interpreter's tiles (8 words x 16 rows; the GEMM's 16 x 32 x 32), so every mask is
# exercised. int8 K = 83 is not whole 32-bit words: the GEMM kernel serves it at every M.
LLAMA_8B = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (128256, 4096)]
INT8_SHAPES = LLAMA_8B if ON_GPU else [(37, 84), (20, 256), (37, 83)]
# (N, K, group size)
INT4_SHAPES = [(n, k, 128) for n, k in LLAMA_8B] + [(4096, 4096, 32)] if ON_GPU else [
    (37, 224, 32), (20, 256, 128), (37, 96, 24)]
ROWS = [1, 4, 33] if ON_GPU else [1, 2, 3, 8, 33]


def _dtype_for(gemm: bool, dtype):
    return torch.float16 if not ON_GPU and gemm and dtype == torch.bfloat16 else dtype


DTYPES = [torch.bfloat16] if ON_GPU else [torch.float32, torch.bfloat16]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("m", ROWS)
@pytest.mark.parametrize("n, k", INT8_SHAPES)
def test_int8_linear_matches_reference(n, k, m, dtype):
    dtype = _dtype_for(m > 8 or k % 4 != 0, dtype)
    gen = generator(n + k + m)
    weight, scale = _int8_weights(n, k, gen)
    x = _x(m, k, dtype, gen)
    bias = _bias(n, dtype, gen, with_bias=m % 2 == 1)

    ref = gemv_ref(x, dequantize_int8(weight, scale), bias)
    _assert_close(int8_linear(x, weight, scale, bias), ref)
    if m > 8:  # the GEMM kernel too, whichever path M picks
        _assert_close(int8_linear(x, weight, scale, bias, kernel="gemm"), ref)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("m", ROWS)
@pytest.mark.parametrize("n, k, group", INT4_SHAPES)
def test_int4_linear_matches_reference(n, k, group, m, dtype):
    dtype = _dtype_for(m > 8, dtype)
    gen = generator(n + k + m + group)
    packed, scale, zero = _int4_weights(n, k, group, gen)
    x = _x(m, k, dtype, gen)
    bias = _bias(n, dtype, gen, with_bias=m % 2 == 1)

    ref = gemv_ref(x, dequantize_int4(packed, scale, zero, group), bias)
    _assert_close(int4_linear(x, packed, scale, zero, group, bias), ref)
    if m > 8:
        _assert_close(int4_linear(x, packed, scale, zero, group, bias, kernel="gemm"), ref)


# (N, K, split_k): whole tiles per split, ragged splits, and on the CPU 12 words in 4 splits of 8, the last two
# empty; on the GPU a narrow tall-K matrix at every split. x rows with an odd pad lose 16-byte alignment.
SPLIT_CASES = [(1024, 14336, s) for s in (1, 2, 4, 8, None)] if ON_GPU else [(29, 128, 2), (37, 224, 3),
                                                                              (6, 96, 4)]


@pytest.mark.parametrize("m", [1, 3])
@pytest.mark.parametrize("n, k, split_k", SPLIT_CASES, ids=str)
def test_split_k(n, k, split_k, m):
    gen = generator(n + m + (split_k or 0))
    x = _x(m, k, torch.float16, gen, pad=5)
    bias = _bias(n, torch.float16, gen, with_bias=m > 1)
    weight, scale = _int8_weights(n, k, gen)
    packed, scale4, zero = _int4_weights(n, k, 32, gen)

    _assert_close(int8_linear(x, weight, scale, bias, split_k=split_k),
                  gemv_ref(x, dequantize_int8(weight, scale), bias))
    _assert_close(int4_linear(x, packed, scale4, zero, 32, bias, split_k=split_k),
                  gemv_ref(x, dequantize_int4(packed, scale4, zero, 32), bias))


# The GEMV variant that loads its first weight tile before waiting for the previous kernel (programmatic dependent
# launch on the GPU; on the CPU the same code without the wait), and the one that does not.
@pytest.mark.parametrize("pdl", [True, False], ids=["prefetch", "plain"])
def test_first_tile_prefetch(pdl):
    n, k = (6144, 4096) if ON_GPU else (37, 224)
    gen = generator(5)
    x = _x(2, k, torch.bfloat16, gen)
    weight, scale = _int8_weights(n, k, gen)
    packed, scale4, zero = _int4_weights(n, k, 32, gen)

    _assert_close(int8_linear(x, weight, scale, pdl=pdl), gemv_ref(x, dequantize_int8(weight, scale)))
    _assert_close(int4_linear(x, packed, scale4, zero, 32, pdl=pdl),
                  gemv_ref(x, dequantize_int4(packed, scale4, zero, 32)))


def test_results_are_deterministic():
    n, k = (1024, 14336) if ON_GPU else (37, 224)
    gen = generator(6)
    x = _x(2, k, torch.bfloat16, gen)
    packed, scale, zero = _int4_weights(n, k, 32, gen)

    first = int4_linear(x, packed, scale, zero, 32, split_k=3)

    assert torch.equal(int4_linear(x, packed, scale, zero, 32, split_k=3), first)


@pytest.mark.skipif(not ON_GPU, reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("m", [1, 4, 64])
def test_replays_in_a_cuda_graph(m):
    n, k = 4096, 14336
    gen = generator(7 + m)
    x = _x(m, k, torch.bfloat16, gen)
    bias = _bias(n, torch.bfloat16, gen, with_bias=True)
    weight, scale = _int8_weights(n, k, gen)
    packed, scale4, zero = _int4_weights(n, k, 128, gen)
    out8 = torch.empty(m, n, dtype=torch.bfloat16, device=DEVICE)
    out4 = torch.empty_like(out8)

    def step():
        out8.copy_(int8_linear(x, weight, scale, bias))
        out4.copy_(int4_linear(x, packed, scale4, zero, 128, bias))

    step()  # autotunes outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    x.copy_(torch.randn(x.shape, generator=gen, device=DEVICE))
    out8.fill_(float("nan"))
    out4.fill_(float("nan"))
    graph.replay()

    _assert_close(out8, gemv_ref(x, dequantize_int8(weight, scale), bias))
    _assert_close(out4, gemv_ref(x, dequantize_int4(packed, scale4, zero, 128), bias))


@pytest.mark.parametrize("group", [0, 12, 64])
def test_int4_rejects_group_sizes_that_do_not_tile_k(group):
    gen = generator(8)
    packed, scale, zero = _int4_weights(4, 96, 32, gen)
    with pytest.raises(ValueError, match="group_size"):
        int4_linear(_x(1, 96, torch.float32, gen), packed, scale, zero, group)


@pytest.mark.parametrize("n, row_bytes, expected", [(4096, 7168, 1), (28672, 2048, 1), (1024, 7168, 1),
                                                    (512, 16384, 4), (512, 8192, 2), (256, 16384, 4), (64, 65536, 8)])
def test_choose_split_k(n, row_bytes, expected):
    assert choose_split_k(n, row_bytes) == expected


# The path large batches and prefill chunks take: the weight dequantized into scratch, then cuBLAS (torch on the
# CPU). Shapes of different sizes in turn, so the scratch is reused at another shape and grows.
DEQUANTIZE_ROWS = [64, 256] if ON_GPU else [9, 40]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("m", DEQUANTIZE_ROWS)
def test_dequantized_matmul_matches_reference(m, dtype):
    for i, ((n8, k8), (n4, k4, group)) in enumerate(zip(INT8_SHAPES, INT4_SHAPES)):
        gen = generator(m + i)
        weight, scale = _int8_weights(n8, k8, gen)
        x = _x(m, k8, dtype, gen)
        bias = _bias(n8, dtype, gen, with_bias=i % 2 == 0)
        _assert_close(int8_linear(x, weight, scale, bias, kernel="dequantize"),
                      gemv_ref(x, dequantize_int8(weight, scale), bias))
        packed, scale4, zero = _int4_weights(n4, k4, group, gen)
        x = _x(m, k4, dtype, gen)
        bias = _bias(n4, dtype, gen, with_bias=i % 2 == 1)
        _assert_close(int4_linear(x, packed, scale4, zero, group, bias, kernel="dequantize"),
                      gemv_ref(x, dequantize_int4(packed, scale4, zero, group), bias))


# The tensor-core GEMV at 1, 3 and 8 rows, both 16-bit dtypes, groups of one and two blocks, split and not; N that
# leave part of a 32-row tile, and block counts that leave warps without a block in the last step (on the CPU the
# mma emulated, see quant_mma_gemv).
MMA_CASES = ([(6144, 4096, 128), (4096, 14336, 128), (28672, 4096, 256), (6184, 4224, 128)] if ON_GPU else
             [(37, 640, 128), (50, 512, 256), (16, 1152, 128)])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("m", [1, 3, 8])
@pytest.mark.parametrize("n, k, group", MMA_CASES)
def test_int4_tensor_core_gemv_matches_reference(n, k, group, m, dtype):
    gen = generator(n + k + m + group)
    packed, scale, zero = _int4_weights(n, k, group, gen)
    x = _x(m, k, dtype, gen)
    bias = _bias(n, dtype, gen, with_bias=m != 3)

    ref = gemv_ref(x, dequantize_int4(packed, scale, zero, group), bias)
    for split_k in (None, 3):
        _assert_close(int4_linear(x, packed, scale, zero, group, bias, kernel="mma", split_k=split_k), ref)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("k", [4096, 4224] if ON_GPU else [512, 640])
def test_every_tensor_core_gemv_config(k, dtype):
    """Autotuning runs one configuration per shape; each must be right, with whole steps of blocks for every warp
    and without (33 blocks), in both PTX variants (on the CPU both tile counts)."""
    from rtx_kernels import quant_mma_gemv

    n = 4136 if ON_GPU else 40
    gen = generator(12 + k)
    packed, scale, zero = _int4_weights(n, k, 128, gen)
    x = _x(3, k, dtype, gen)
    bias = _bias(n, dtype, gen, with_bias=True)
    ref = gemv_ref(x, dequantize_int4(packed, scale, zero, 128), bias)
    kernel = quant_mma_gemv._mma_gemv_kernel
    configs = quant_mma_gemv._GPU_CONFIGS if ON_GPU else [quant_mma_gemv._config(1, 1), quant_mma_gemv._config(2, 2)]
    saved = kernel.configs, kernel.cache
    try:
        for config in configs:
            kernel.configs, kernel.cache = [config], {}
            for split_k in (1, 2):
                _assert_close(int4_linear(x, packed, scale, zero, 128, bias, kernel="mma", split_k=split_k), ref)
    finally:
        kernel.configs, kernel.cache = saved


def test_tensor_core_gemv_choice_and_its_checks(monkeypatch):
    from rtx_kernels import quant_matmul, quant_mma_gemv

    monkeypatch.setattr(quant_matmul, "_int4_mma_enabled", lambda: True)  # whatever RTX_INT4_MMA says
    gen = generator(13)
    packed, scale, zero = _int4_weights(20, 256, 128, gen)
    packed32, scale32, zero32 = _int4_weights(20, 256, 32, gen)
    x16, x32 = _x(2, 256, torch.bfloat16, gen), _x(2, 256, torch.float32, gen)
    calls = []
    real = quant_mma_gemv.int4_mma_gemv
    monkeypatch.setattr(quant_mma_gemv, "int4_mma_gemv", lambda *a, **kw: (calls.append(a[0].dtype), real(*a, **kw)))
    int4_linear(x16, packed, scale, zero, 128)  # 2 rows of 16-bit x, whole-block groups: the tensor cores
    int4_linear(x16[:1], packed, scale, zero, 128)  # one row: the FMA GEMV
    int4_linear(x32, packed, scale, zero, 128)  # float32 x: the FMA GEMV
    int4_linear(x16, packed32, scale32, zero32, 32)  # groups smaller than a block: the FMA GEMV
    int4_linear(_x(2, 256, torch.bfloat16, gen, pad=5), packed, scale, zero, 128)  # odd row stride: FMA
    assert calls == [torch.bfloat16]
    monkeypatch.undo()
    for x, args in ((x32, (packed, scale, zero, 128)), (x16, (packed32, scale32, zero32, 32)),
                    (_x(9, 256, torch.bfloat16, gen), (packed, scale, zero, 128)),
                    (_x(2, 256, torch.bfloat16, gen, pad=5), (packed, scale, zero, 128))):
        with pytest.raises(ValueError, match="tensor-core GEMV"):
            int4_linear(x, *args, kernel="mma")
    weight, scale8 = _int8_weights(20, 256, gen)
    with pytest.raises(ValueError, match="int4 weights only"):
        int8_linear(x16, weight, scale8, kernel="mma")


@pytest.mark.parametrize("with_bias", [False, True])
def test_no_columns_is_an_empty_sum(with_bias):
    gen = generator(14)
    x = _x(2, 0, torch.bfloat16, gen, pad=0)
    bias = _bias(5, torch.bfloat16, gen, with_bias)
    expected = bias.expand(2, 5) if with_bias else torch.zeros(2, 5, dtype=torch.bfloat16, device=DEVICE)
    weight8 = torch.zeros(5, 0, dtype=torch.int8, device=DEVICE)
    assert torch.equal(int8_linear(x, weight8, torch.ones(5, device=DEVICE), bias), expected)
    packed = torch.zeros(5, 0, dtype=torch.int32, device=DEVICE)
    scale, zero = torch.ones(5, 0, device=DEVICE), torch.zeros(5, 0, dtype=torch.uint8, device=DEVICE)
    assert torch.equal(int4_linear(x, packed, scale, zero, 128, bias), expected)


def test_kernel_choice_by_rows_and_its_checks():
    gen = generator(11)
    packed, scale, zero = _int4_weights(37, 224, 32, gen)
    x = _x(9, 224, torch.float32, gen)
    with pytest.raises(ValueError, match="at most 8 rows"):
        int4_linear(x, packed, scale, zero, 32, kernel="gemv")
    with pytest.raises(ValueError, match="not one of"):
        int4_linear(x, packed, scale, zero, 32, kernel="marlin")
    first = DEQUANTIZE_MIN_M[8]
    assert [_choose_kernel(None, m, 8, True) for m in (1, 8, 9, first - 1, first)] == [
        "gemv", "gemv", "gemm", "gemm", "dequantize"]
    assert [_choose_kernel(None, m, 4, True) for m in (8, 9)] == ["gemv", "dequantize"]
    assert _choose_kernel(None, 1, 8, gemv_fits=False) == "gemm"


def test_outgrown_scratch_stays_alive_for_captured_graphs():
    """A CUDA graph captured while a smaller scratch buffer was current keeps writing into it on replay: growing the
    buffer for a larger layer must not free the old one."""
    from rtx_kernels import quant_dequantize

    dtype = torch.float64  # a key no other test uses
    small = quant_dequantize._scratch_weight(4, 8, dtype, torch.device(DEVICE))
    assert quant_dequantize._scratch_weight(2, 8, dtype, torch.device(DEVICE)).data_ptr() == small.data_ptr()
    large = quant_dequantize._scratch_weight(16, 8, dtype, torch.device(DEVICE))
    assert large.data_ptr() != small.data_ptr()
    assert any(b.data_ptr() == small.data_ptr() for b in quant_dequantize._retired_scratch)
