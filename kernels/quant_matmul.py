"""``y = x @ W.T (+ bias)`` with W stored as int8 or int4 (weight-only quantization), in Triton.

The formats are those of :mod:`rtx_kernels.quant_reference`: int8 per output channel (``weight`` int8 [N, K],
``scale`` [N]) and int4 in asymmetric groups along K (``packed`` int32 [N, K/8], ``scale`` [N, K/G], ``zero``
uint8 [N, K/G]). ``x`` is [M, K] in float32, float16 or bfloat16; the output takes its dtype.

Decode (M <= 8) is bound by reading the weight, so the GEMV kernel is written for bandwidth: each program owns
``BLOCK_N`` rows and streams them along K, each thread 16 bytes of a row at a time (4 words of 8 int4 or 4 int8
columns), every word multiplied by all M rows of x before the next is loaded, with float32 accumulators. The
next tile's loads are issued into registers before the current one is computed. At 4 bytes per 8 weights the
kernel is bound by instruction issue as much as by memory: ``cvt`` from integer to float runs at a sixteenth of
the FMA rate on Hopper, so the floats are built from bits instead (a shift, one LOP3 and the FMA per weight, see
:func:`_word_sums`), and the zero point and scale are applied once per 8 weights. Narrow, tall-K matrices also
split K, as :mod:`rtx_kernels.gemv` does, with the same fixed-order reduce.

Measured on the H200 with benchmarks/quant_sweep.py (Triton 3.6; Llama-3.1-8B projections, x bf16, M=1): int8
2.4-4.4 TB/s of weight bytes, 1.3-1.9x faster than the bf16 ``gemv``; int4 (groups of 128) 1.4-2.9 TB/s,
1.5-2.4x faster than it, the larger matrices (gate_up, LM head) gaining most.

Larger M has two paths. A tiled GEMM dequantizes weight tiles in registers to x's dtype and feeds them to
``tl.dot``; at M=256 on the H200 it ran at only 0.4-0.6x (int8) and 0.15-0.3x (int4) the speed of bf16 cuBLAS, the
dequantized tile going through shared memory to the tensor cores every K step. The other dequantizes the whole
weight once into a scratch buffer in x's dtype and lets cuBLAS run the product: it pays for writing and reading 2
bytes a weight, and wins where the GEMM is slow. ``DEQUANTIZE_MIN_M`` (per format, from measurements) says where the
second takes over: for int4 right after the GEMV's rows, for int8 only at large batches and prefill chunks. Both
dequantizing pieces live in :mod:`rtx_kernels.quant_dequantize`.

Grids depend only on shapes and nothing syncs with the host, so calls can be captured in a CUDA graph once each
autotuning key has been seen (the engine's warm-up run does that).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from rtx_kernels import quant_mma_gemv
from rtx_kernels.gemv import _num_sms, reduce_splits, split_target
from rtx_kernels.pdl import gemv_launch_mode, launch_options, wait_for_previous
from rtx_kernels.quant_dequantize import dequantize_int4_tile, dequantized_matmul

_MAX_GEMV_M = 8
# From this many rows of x on (by bits), dequantize to scratch and use cuBLAS (see the module docstring). Measured
# with benchmarks/quant_sweep.py on the H200 at Llama-3.1-8B's projections (M = 16, 64, 256): the int4 GEMM lost
# to it at every M from 16 on but one (gate_up at 64: 136 against 162 us); the int8 GEMM won at 16 and 64 rows and
# broke even at 256 (367 against 356 us over the four projections). 128 for int8 lies between, not measured.
DEQUANTIZE_MIN_M = {4: 9, 8: 128}
KERNELS = ("gemv", "mma", "gemm", "dequantize")
# int4 decode products of 2 to 8 rows of 16-bit x, with groups of whole 128-column blocks, run on the tensor cores
# (rtx_kernels.quant_mma_gemv); RTX_INT4_MMA=0 sends them to the FMA GEMV instead (A/B measurements).
_INT4_MMA = os.environ.get("RTX_INT4_MMA", "1") != "0"
_MAX_SPLIT_K = 8
# A split reading fewer bytes per row than this streams too briefly to pay for its share of the reduce launch
# (the bf16 GEMV's 2048 columns, measured on the H200).
_MIN_BYTES_PER_SPLIT = 4096
_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
_USE_ASM = tl.constexpr(not _INTERPRET)
# (a & mask) | magic and (a & mask) ^ magic, the int8 magic flipping the byte's sign bit as it sets the exponent.
_LOP3_INT4 = tl.constexpr("lop3.b32 $0, $1, 0x00780000, 0x41800000, 0xEA;")
_LOP3_INT8 = tl.constexpr("lop3.b32 $0, $1, 0x007F8000, 0x43C00000, 0x6A;")


def _gemv_config(block_n: int, num_warps: int, chunks: int = 1) -> triton.Config:
    # One vector of VEC words per thread, chunk and row, the warps along K.
    return triton.Config({"BLOCK_N": block_n, "BLOCK_V": 32 * num_warps * chunks}, num_warps=num_warps,
                         num_stages=1)


_GEMV_GPU_CONFIGS = [
    _gemv_config(1, 4),
    _gemv_config(2, 4),
    _gemv_config(4, 4),
    _gemv_config(8, 4),
    _gemv_config(2, 8),
    _gemv_config(4, 8),
    _gemv_config(4, 2),
    _gemv_config(8, 2),
    _gemv_config(1, 4, chunks=2),
    _gemv_config(2, 4, chunks=2),
]
# The interpreter runs every config for real: one small one, whose blocks the tests' odd shapes straddle.
_GEMV_INTERPRETER_CONFIGS = [triton.Config({"BLOCK_N": 16, "BLOCK_V": 4}, num_warps=1, num_stages=1)]
# Registers per thread a config may plan for: two weight tiles in flight (words, scales and, for int4, zero
# points), x and the sums of one tile, the accumulators. Past it ptxas spills or too few warps fit to keep loads
# in flight.
_MAX_GEMV_REGS = 192


def _prune_gemv_configs(configs, named_args, **kwargs):
    bits, vec, rows_m = kwargs["BITS"], kwargs["VEC"], kwargs["BLOCK_M"]

    def regs(c: triton.Config) -> int:
        chunks = c.kwargs["BLOCK_V"] // (32 * c.num_warps)
        rows_n = c.kwargs["BLOCK_N"]
        tile = rows_n * (vec + (2 if bits == 4 else 1))
        return chunks * (2 * tile + vec * 32 // bits * rows_m + 2 * rows_m * rows_n + rows_m)

    fitting = [c for c in configs if regs(c) <= _MAX_GEMV_REGS]
    return fitting or [min(configs, key=regs)]


def _gemv_vec(bits: int, group: int) -> int:
    """Words per thread and row: 4 (16-byte loads) where 4 words never straddle an int4 group."""
    return 4 if bits == 8 or group % 32 == 0 else 1


def _gemm_config(bm: int, bn: int, bk: int, num_warps: int, stages: int) -> triton.Config:
    return triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": 8}, num_warps=num_warps,
                         num_stages=stages)


_GEMM_GPU_CONFIGS = [
    _gemm_config(128, 128, 64, 8, 3),
    _gemm_config(128, 256, 64, 8, 3),
    _gemm_config(64, 128, 64, 4, 4),
    _gemm_config(128, 64, 64, 4, 4),
    _gemm_config(64, 64, 128, 4, 3),
    _gemm_config(32, 128, 128, 4, 3),
    _gemm_config(16, 128, 128, 4, 4),
    _gemm_config(16, 64, 256, 4, 3),
    _gemm_config(128, 128, 32, 4, 4),
    _gemm_config(64, 128, 32, 4, 5),
    # Two warpgroups on 256 rows dequantize each weight tile once for twice the rows.
    _gemm_config(256, 128, 32, 8, 3),
    _gemm_config(256, 128, 64, 8, 3),
]
_GEMM_INTERPRETER_CONFIGS = [_gemm_config(16, 32, 32, 1, 1)]


def _prune_gemm_configs(configs, named_args, **kwargs):
    # Row tiles past the bucket are wasted work; K tiles inside one group load one scale per row.
    fitting = [c for c in configs if c.kwargs["BLOCK_M"] <= max(16, named_args["M_BUCKET"])]
    if kwargs["BITS"] == 4:
        fitting = [c for c in fitting if kwargs["GROUP"] % c.kwargs["BLOCK_K"] == 0] or fitting
    return fitting or configs[:1]


def choose_split_k(n: int, row_bytes: int, num_sms: int = 132) -> int:
    """Splits of K only when N is too narrow to give every SM an 8-row tile, each split keeping >= 4 KiB a row."""
    split = 1
    while (split < _MAX_SPLIT_K and triton.cdiv(n, 8) * split < num_sms
           and row_bytes // (2 * split) >= _MIN_BYTES_PER_SPLIT):
        split *= 2
    return split


@triton.jit
def _slots(t, VEC: tl.constexpr):
    """[a, b, VEC] -> VEC tiles [a, b], tile v holding element v of each vector (in-thread: no data moves)."""
    if VEC == 1:
        return (tl.reshape(t, [t.shape[0], t.shape[1]]),)
    else:
        a0, a1 = tl.split(tl.reshape(t, [t.shape[0], t.shape[1], 2, 2]))
        s0, s2 = tl.split(a0)
        s1, s3 = tl.split(a1)
        return s0, s1, s2, s3


@triton.jit
def _x_planes(xt, PER_WORD: tl.constexpr):
    """x tile [vectors, rows of x, PER_WORD] -> PER_WORD tiles [vectors, rows of x], tile j holding column j of
    each word (in-thread: no data moves)."""
    if PER_WORD == 4:
        return _slots(xt, 4)
    else:
        a0, a1 = tl.split(tl.reshape(xt, [xt.shape[0], xt.shape[1], 4, 2]))
        p0, p2, p4, p6 = _slots(a0, 4)
        p1, p3, p5, p7 = _slots(a1, 4)
        return p0, p1, p2, p3, p4, p5, p6, p7


@triton.jit
def _float_from_bits(bits, BITS: tl.constexpr):
    """The column sitting in bits 19..22 (int4) or 15..22 (int8) of ``bits`` as float32 16 + q or 384 + b (see
    :func:`_word_sums`). One LOP3 on the GPU; from plain ``&`` and ``|`` ptxas makes one per constant."""
    if _USE_ASM:
        bits = tl.inline_asm_elementwise(_LOP3_INT4 if BITS == 4 else _LOP3_INT8, "=r,r", [bits], dtype=tl.int32,
                                         is_pure=True, pack=1)
    elif BITS == 4:
        bits = (bits & 0x780000) | 0x41800000
    else:
        bits = (bits & 0x7F8000) ^ 0x43C00000
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _word_sums(acc, words, planes, BITS: tl.constexpr):
    """acc + sum_j f_j * x_j over the columns j of each word, [vectors, rows of x, N], without a cvt.

    Each column's integer is shifted into the top of a float's mantissa under a constant exponent, which makes
    f_j an affine function of it, exact: int4 f_j = 16 + q_j (0x41800000 | q << 19); int8 f_j = 384 + b_j
    (0x43800000 | (b + 128) << 15, the + 128 being the flip of the byte's sign bit). The caller subtracts the
    constant times sum_j x_j once per word and row.
    """
    for j in tl.static_range(32 // BITS):
        top = 23 - BITS  # where the column's lowest bit goes
        if BITS * j <= top:
            bits = words << (top - BITS * j)
        else:
            bits = words >> (BITS * j - top)  # arithmetic, but the mask drops the sign bits
        acc += planes[j][:, :, None] * _float_from_bits(bits, BITS)[:, None, :]
    return acc


@triton.jit
def _load_weight_tile(w_ptrs, s_ptrs, z_ptrs, w0, w_hi, word_idx, first_word,
                      BITS: tl.constexpr, GROUP: tl.constexpr, PER_WORD: tl.constexpr, VEC: tl.constexpr,
                      EVEN_K: tl.constexpr):
    """The weight words [vectors, N, VEC] and the scale [vectors, N] of each vector of VEC words (int4: its group's,
    one group as the wrapper picks VEC; int8: its row's) with, for int4, the group's zero point."""
    if EVEN_K:
        mask, nothing = None, None
    else:
        mask, nothing = w0 + word_idx < w_hi, 0
    words = tl.load(w_ptrs + w0, mask=mask, other=nothing)
    if BITS == 4:
        group = ((w0 + first_word) * PER_WORD // GROUP)[:, None]
        if EVEN_K:
            group_mask = None
        else:
            group_mask = (w0 + first_word < w_hi)[:, None]
        return (words, tl.load(s_ptrs + group, mask=group_mask, other=nothing),
                tl.load(z_ptrs + group, mask=group_mask, other=nothing))
    else:
        # The same [vectors, N] shape as int4's scales, so both take the same layout.
        return words, tl.load(s_ptrs + (first_word * 0)[:, None]), words


@triton.jit
def _accumulate(acc, tile, x_ptrs, w0, w_hi, first_word,
                BITS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr,
                VEC: tl.constexpr, EVEN_K: tl.constexpr):
    PER_WORD: tl.constexpr = 32 // BITS
    words, s, z = tile
    sums = tl.zeros([BLOCK_V, BLOCK_M, BLOCK_N], tl.float32)
    x_sums = tl.zeros([BLOCK_V, BLOCK_M], tl.float32)
    slots = _slots(words, VEC)
    for v in tl.static_range(VEC):
        # x of word VEC * i + v for every vector i: one vector load, laid out as the weight slot it meets.
        if EVEN_K:
            xt = tl.load(x_ptrs + (w0 + v) * PER_WORD)
        else:
            mask = (w0 + first_word + v < w_hi)[:, None, None]
            xt = tl.load(x_ptrs + (w0 + v) * PER_WORD, mask=mask, other=0.0)
        xt = xt.to(tl.float32)
        sums = _word_sums(sums, slots[v], _x_planes(xt, PER_WORD), BITS)
        x_sums += tl.sum(xt, axis=2)
    if BITS == 8:
        # sum_j b_j s x_j = s * (sum_j (384 + b_j) x_j - 384 sum_j x_j)
        acc += s[:, None, :] * (sums - 384.0 * x_sums[:, :, None])
    else:
        # sum_j (q_j - z) s x_j = s * (sum_j (16 + q_j) x_j - (16 + z) sum_j x_j)
        acc += s[:, None, :] * (sums - (z.to(tl.float32) + 16.0)[:, None, :] * x_sums[:, :, None])
    return acc


@triton.autotune(configs=_GEMV_INTERPRETER_CONFIGS if _INTERPRET else _GEMV_GPU_CONFIGS,
                 key=["N", "NUM_WORDS", "BLOCK_M", "SPLIT_K", "BITS", "GROUP", "VEC", "PREFETCH"],
                 prune_configs_by={"early_config_prune": _prune_gemv_configs})
@triton.heuristics({"EVEN_K": lambda args: args["NUM_WORDS"] % (args["BLOCK_V"] * args["VEC"] * args["SPLIT_K"])
                    == 0})
# Unspecialized, a scale stride of 1 (int8's [N] scales) is not known to be contiguous along N, which would give
# the threads to N rather than K (see the tile layouts below).
@triton.jit(do_not_specialize=["stride_sn"])
def _gemv_kernel(
    x_ptr, w_ptr, scale_ptr, zero_ptr, bias_ptr, out_ptr,
    M, N, NUM_WORDS,
    stride_xm, stride_wn, stride_sn, stride_om, stride_os,
    BITS: tl.constexpr, GROUP: tl.constexpr, VEC: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr,
    SPLIT_K: tl.constexpr, PREFETCH: tl.constexpr, USE_PDL: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, EVEN_K: tl.constexpr,
):
    PER_WORD: tl.constexpr = 32 // BITS
    BLOCK_W: tl.constexpr = BLOCK_V * VEC
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = rows < N
    # Past-the-end rows re-read row N-1 and rows of the M bucket past M re-read row M-1, so full tiles load
    # unpredicated; their results are dropped at the store.
    rows_c = tl.minimum(rows, N - 1)
    x_rows = tl.minimum(tl.arange(0, BLOCK_M), M - 1)
    vectors = tl.arange(0, BLOCK_V)
    words_per_split = tl.cdiv(tl.cdiv(NUM_WORDS, SPLIT_K), BLOCK_W) * BLOCK_W
    w_lo = pid_k * words_per_split
    w_hi = tl.minimum(w_lo + words_per_split, NUM_WORDS)

    # Tiles are [vectors, N, VEC] and [vectors, rows of x, PER_WORD]: each thread loads VEC whole words of each
    # row (one vector) and, per word, the columns of x they meet. The coalescing pass gives the threads to the
    # most contiguous dimension, and on a tie (Triton 3.6) to the first: vectors lead, so that weights, scales
    # and x all land with the threads along K, in layouts that meet without going through shared memory.
    first_word = vectors * VEC
    word_idx = first_word[:, None, None] + tl.arange(0, VEC)[None, None, :]
    w_ptrs = w_ptr + rows_c.to(tl.int64)[None, :, None] * stride_wn + word_idx
    s_ptrs = scale_ptr + rows_c[None, :] * stride_sn
    z_ptrs = zero_ptr + rows_c[None, :] * stride_sn
    x_ptrs = (x_ptr + x_rows[None, :, None] * stride_xm + first_word[:, None, None] * PER_WORD
              + tl.arange(0, PER_WORD)[None, None, :])
    acc = tl.zeros([BLOCK_V, BLOCK_M, BLOCK_N], tl.float32)

    # The loop computes on one weight tile while the loads of the next are in flight, from registers: no shared
    # memory and no barrier per iteration. With PREFETCH the first tile is loaded before waiting for the previous
    # kernel (programmatic dependent launch: weights are never written during a step), so its stream overlaps that
    # kernel's tail and the launch gap.
    if not PREFETCH:
        wait_for_previous(USE_PDL)
    tile = _load_weight_tile(w_ptrs, s_ptrs, z_ptrs, w_lo, w_hi, word_idx, first_word, BITS, GROUP, PER_WORD, VEC,
                             EVEN_K)
    if PREFETCH:
        wait_for_previous(USE_PDL)
    for w0 in tl.range(w_lo, w_hi, BLOCK_W, num_stages=1):
        if EVEN_K:
            # The last iteration re-reads its own tile instead of one past the split.
            w_next = tl.minimum(w0 + BLOCK_W, w_hi - BLOCK_W)
        else:
            w_next = w0 + BLOCK_W
        next_tile = _load_weight_tile(w_ptrs, s_ptrs, z_ptrs, w_next, w_hi, word_idx, first_word, BITS, GROUP,
                                      PER_WORD, VEC, EVEN_K)
        acc = _accumulate(acc, tile, x_ptrs, w0, w_hi, first_word, BITS, BLOCK_M, BLOCK_N, BLOCK_V, VEC, EVEN_K)
        tile = next_tile

    y = tl.sum(acc, axis=0)  # [BLOCK_M, BLOCK_N]
    # With SPLIT_K > 1, out is the fp32 partial buffer [SPLIT_K, M, N] and the reduce kernel adds the bias.
    if HAS_BIAS and SPLIT_K == 1:
        y += tl.load(bias_ptr + rows_c).to(tl.float32)[None, :]
    m = tl.arange(0, BLOCK_M)
    out_ptrs = out_ptr + pid_k * stride_os + m[:, None] * stride_om + rows[None, :]
    tl.store(out_ptrs, y.to(out_ptr.dtype.element_ty), mask=(m < M)[:, None] & row_mask[None, :])


@triton.autotune(configs=_GEMM_INTERPRETER_CONFIGS if _INTERPRET else _GEMM_GPU_CONFIGS,
                 key=["N", "K", "M_BUCKET", "BITS", "GROUP"],
                 prune_configs_by={"early_config_prune": _prune_gemm_configs})
@triton.heuristics({"EVEN_K": lambda args: args["K"] % args["BLOCK_K"] == 0})
@triton.jit
def _gemm_kernel(
    x_ptr, w_ptr, scale_ptr, zero_ptr, bias_ptr, out_ptr,
    M, N, K,
    stride_xm, stride_wn, stride_sn, stride_om,
    M_BUCKET,  # only an autotuning key: M rounded up to a power of 2
    BITS: tl.constexpr, GROUP: tl.constexpr, HAS_BIAS: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    EVEN_K: tl.constexpr,
):
    # Row tiles go in groups of GROUP_M along M, so the programs running together share weight tiles in L2.
    pid = tl.program_id(0)
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * num_n
    first_m = pid // per_group * GROUP_M
    group_rows = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % group_rows
    pid_n = (pid % per_group) // group_rows

    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rn_c = tl.minimum(rn, N - 1)
    rk = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + tl.minimum(rm, M - 1).to(tl.int64)[:, None] * stride_xm + rk[None, :]
    if BITS == 8:
        w_ptrs = w_ptr + rn_c.to(tl.int64)[:, None] * stride_wn + rk[None, :]
    else:
        w_ptrs = w_ptr + rn_c.to(tl.int64)[:, None] * stride_wn + tl.arange(0, BLOCK_K // 8)[None, :]
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        if EVEN_K:
            x = tl.load(x_ptrs + k0)
        else:
            x = tl.load(x_ptrs + k0, mask=(k0 + rk < K)[None, :], other=0.0)
        if BITS == 8:
            if EVEN_K:
                q = tl.load(w_ptrs + k0)
            else:
                q = tl.load(w_ptrs + k0, mask=(k0 + rk < K)[None, :], other=0)
            # 0x4B000000 | (byte ^ 0x80) is the float 2^23 + q + 128: exact, and no cvt (a sixteenth of the FMA
            # rate); the scale is applied to the sums.
            q = ((q.to(tl.int32) & 0xFF) ^ 0x4B000080).to(tl.float32, bitcast=True) - 8388736.0
            w = q.to(x.dtype)
        else:
            w = dequantize_int4_tile(w_ptrs, scale_ptr, zero_ptr, rn_c, stride_sn, k0, K, rk, x.dtype, GROUP,
                                      BLOCK_N, BLOCK_K, EVEN_K)
        acc = tl.dot(x, tl.trans(w), acc, input_precision=DOT_PRECISION)

    if BITS == 8:
        acc *= tl.load(scale_ptr + rn_c)[None, :]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + rn_c).to(tl.float32)[None, :]
    out_ptrs = out_ptr + rm.to(tl.int64)[:, None] * stride_om + rn[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=(rm < M)[:, None] & (rn < N)[None, :])


def int8_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None, *,
                split_k: int | None = None, pdl: bool | None = None, kernel: str | None = None) -> torch.Tensor:
    """``x @ (weight * scale[:, None]).T + bias`` for ``x`` [M, K], int8 ``weight`` [N, K], float32 ``scale`` [N].

    Returns [M, N] in ``x``'s dtype. ``x`` may have strided rows. M <= 8 runs the GEMV kernel (where K is a
    multiple of 4, so rows are whole 32-bit words), M below :data:`DEQUANTIZE_MIN_M` the GEMM kernel, larger M a
    dequantized copy of the weight through cuBLAS.

    :param kernel: one of :data:`KERNELS` instead of the choice by M (benchmarks and tests); "gemv" needs M <= 8;
        "mma" is int4's only.

    :param split_k: splits of K for the GEMV; :func:`choose_split_k` when None. Results depend on it in the last
        bits.
    :param pdl: GEMV launched with programmatic dependent launch, its first weight tile loaded before waiting for
        the previous kernel (:mod:`rtx_kernels.pdl`); None: where the device supports it.
    """
    m, k = _check_x(x)
    if weight.dtype != torch.int8 or weight.dim() != 2 or weight.shape[1] != k or weight.stride(1) != 1:
        raise ValueError(f"weight {tuple(weight.shape)} {weight.dtype} must be int8 [N, {k}], contiguous along K")
    n = weight.shape[0]
    if scale.shape != (n,) or scale.dtype != torch.float32 or not scale.is_contiguous():
        raise ValueError(f"scale {tuple(scale.shape)} {scale.dtype} must be a contiguous float32 [{n}]")
    x, out = _prepare(x, bias, n)
    if out.numel() == 0:
        return out
    if k == 0:  # an empty sum; the kernels would read past the empty weight
        return out.copy_(bias.expand_as(out)) if bias is not None else out.zero_()
    whole_words = k % 4 == 0 and weight.stride(0) % 4 == 0 and weight.data_ptr() % 4 == 0
    kernel = _choose_kernel(kernel, m, bits=8, gemv_fits=whole_words)
    if kernel == "mma":
        raise ValueError("the tensor-core GEMV ('mma') takes int4 weights only")
    if kernel == "gemv":
        _gemv(x, weight.view(torch.int32), scale, scale, bias, out, bits=8, group=0, split_k=split_k, pdl=pdl)
    elif kernel == "gemm":
        _gemm(x, weight, scale, scale, bias, out, bits=8, group=0)
    else:
        dequantized_matmul(x, weight, scale, scale, bias, out, bits=8, group=0)
    return out


def int4_linear(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, group_size: int,
                bias: torch.Tensor | None = None, *, split_k: int | None = None,
                pdl: bool | None = None, kernel: str | None = None) -> torch.Tensor:
    """``x @ W.T + bias`` with ``W[n, k] = (q[n, k] - zero[n, k // G]) * scale[n, k // G]``.

    ``packed`` int32 [N, K/8] (column 8i+j in bits 4j..4j+3 of word i), ``scale`` float32 and ``zero`` uint8, both
    contiguous [N, K/G]; G (``group_size``) a multiple of 8 dividing K. Returns [M, N] in ``x``'s dtype; ``x`` may
    have strided rows. Kernels by M, ``split_k``, ``pdl`` and ``kernel`` as for :func:`int8_linear`, except that 2
    to 8 rows of bfloat16 or float16 x with groups of a multiple of 128 go to the tensor-core GEMV ("mma",
    :mod:`rtx_kernels.quant_mma_gemv`; it takes one row too, when asked).
    """
    m, k = _check_x(x)
    if group_size <= 0 or group_size % 8 or k % group_size:
        raise ValueError(f"group_size={group_size} must be a multiple of 8 dividing K={k}")
    if packed.dtype != torch.int32 or packed.dim() != 2 or packed.shape[1] * 8 != k or packed.stride(1) != 1:
        raise ValueError(f"packed {tuple(packed.shape)} {packed.dtype} must be int32 [N, {k // 8}], contiguous "
                         "along K")
    n = packed.shape[0]
    groups = (n, k // group_size)
    if scale.shape != groups or scale.dtype != torch.float32 or not scale.is_contiguous():
        raise ValueError(f"scale {tuple(scale.shape)} {scale.dtype} must be a contiguous float32 {list(groups)}")
    if zero.shape != groups or zero.dtype != torch.uint8 or not zero.is_contiguous():
        raise ValueError(f"zero {tuple(zero.shape)} {zero.dtype} must be a contiguous uint8 {list(groups)}")
    x, out = _prepare(x, bias, n)
    if out.numel() == 0:
        return out
    if k == 0:  # an empty sum; the kernels would read past the empty weight
        return out.copy_(bias.expand_as(out)) if bias is not None else out.zero_()
    # fits() only where it decides something: not for one-row decode steps or prefill chunks.
    if (kernel is None and _INT4_MMA and quant_mma_gemv.MIN_M <= m <= quant_mma_gemv.MAX_M
            and quant_mma_gemv.fits(x, group_size)):
        kernel = "mma"
    elif kernel == "mma" and not quant_mma_gemv.fits(x, group_size):
        raise ValueError(f"the tensor-core GEMV ('mma') takes {quant_mma_gemv.REQUIREMENTS}; got x "
                         f"{tuple(x.shape)} {x.dtype} with strides {x.stride()}, group_size={group_size}")
    kernel = _choose_kernel(kernel, m, bits=4, gemv_fits=True)
    if kernel == "mma":
        quant_mma_gemv.int4_mma_gemv(x, packed, scale, zero, group_size, bias, out, split_k=split_k, pdl=pdl)
    elif kernel == "gemv":
        _gemv(x, packed, scale, zero, bias, out, bits=4, group=group_size, split_k=split_k, pdl=pdl)
    elif kernel == "gemm":
        _gemm(x, packed, scale, zero, bias, out, bits=4, group=group_size)
    else:
        dequantized_matmul(x, packed, scale, zero, bias, out, bits=4, group=group_size)
    return out


def _choose_kernel(kernel: str | None, m: int, bits: int, gemv_fits: bool) -> str:
    if kernel is None:
        return ("gemv" if m <= _MAX_GEMV_M and gemv_fits else
                "gemm" if m < DEQUANTIZE_MIN_M[bits] else "dequantize")
    if kernel not in KERNELS:
        raise ValueError(f"kernel {kernel!r} is not one of {KERNELS}")
    if kernel == "mma":
        return kernel
    if kernel == "gemv" and not (m <= _MAX_GEMV_M and gemv_fits):
        raise ValueError(f"the GEMV kernel takes at most {_MAX_GEMV_M} rows of whole 32-bit words; got M={m}")
    return kernel


def _prepare(x: torch.Tensor, bias: torch.Tensor | None, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` with unit stride along K, and the [M, N] output in its dtype."""
    _check_bias(bias, n)
    out = torch.empty(x.shape[0], n, dtype=x.dtype, device=x.device)
    return (x if x.stride(1) == 1 else x.contiguous()), out


def _check_x(x: torch.Tensor) -> tuple[int, int]:
    if x.dim() != 2 or x.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"x {tuple(x.shape)} {x.dtype} must be [M, K] in float32, float16 or bfloat16")
    return x.shape


def _check_bias(bias: torch.Tensor | None, n: int) -> None:
    if bias is not None and (bias.shape != (n,) or bias.stride(0) != 1):
        raise ValueError(f"bias {tuple(bias.shape)} must be a contiguous [{n}]")


def _gemv(x, words, scale, zero, bias, out, *, bits: int, group: int, split_k: int | None, pdl: bool | None):
    m = x.shape[0]
    n, num_words = words.shape
    if split_k is None:
        sms = _num_sms(x.device.index or 0) if x.is_cuda else 132
        split_k = choose_split_k(n, num_words * 4, sms)
    prefetch, use_pdl = gemv_launch_mode(x.device, pdl)
    target, stride_om, stride_os = split_target(out, split_k)
    stride_sn = scale.stride(0) if bits == 4 else 1
    _gemv_kernel[lambda meta: (triton.cdiv(n, meta["BLOCK_N"]), split_k)](
        x, words, scale, zero, bias if bias is not None else scale, target,
        m, n, num_words,
        x.stride(0), words.stride(0), stride_sn, stride_om, stride_os,
        BITS=bits, GROUP=group, VEC=_gemv_vec(bits, group), HAS_BIAS=bias is not None,
        BLOCK_M=triton.next_power_of_2(m), SPLIT_K=split_k,
        PREFETCH=prefetch, USE_PDL=use_pdl, **launch_options(use_pdl),
    )
    reduce_splits(target, bias, out, split_k, use_pdl)


def _gemm(x, weight, scale, zero, bias, out, *, bits: int, group: int):
    m, k = x.shape
    n = weight.shape[0]
    stride_sn = scale.stride(0) if bits == 4 else 0
    _gemm_kernel[lambda meta: (triton.cdiv(m, meta["BLOCK_M"]) * triton.cdiv(n, meta["BLOCK_N"]),)](
        x, weight, scale, zero, bias if bias is not None else scale, out,
        m, n, k,
        x.stride(0), weight.stride(0), stride_sn, out.stride(0), min(triton.next_power_of_2(m), 1024),
        BITS=bits, GROUP=group, HAS_BIAS=bias is not None,
        # float32 x keeps float32 products (tf32 would round x to 10 bits); 16-bit x ignores it.
        DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
    )
