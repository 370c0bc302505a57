"""Weight-only decode GEMV on the FMA units: ``y = x @ W.T (+ bias)`` for up to 8 rows of ``x`` and int8 or int4
weights, in Triton (the formats of :mod:`rtx_kernels.quant_reference`; :func:`rtx_kernels.quant_matmul.int8_linear`
and ``int4_linear`` check them and choose this kernel or another).

Decode is bound by reading the weight, so the kernel is written for bandwidth: each program owns ``BLOCK_N`` rows
and streams them along K, each thread 16 bytes of a row at a time (4 words of 8 int4 or 4 int8 columns), every word
multiplied by all M rows of x before the next is loaded, with float32 accumulators. The next tile's loads are
issued into registers before the current one is computed. At 4 bytes per 8 weights the kernel is bound by
instruction issue as much as by memory: ``cvt`` from integer to float runs at a sixteenth of the FMA rate on Hopper,
so the floats are built from bits instead (a shift, one LOP3 and the FMA per weight, see :func:`_word_sums`), and
the zero point and scale are applied once per 8 weights. Narrow, tall-K matrices also split K, as
:mod:`rtx_kernels.gemv` does, with the same fixed-order reduce.

Measured on the H200 with a sweep, docs/benchmarks.md (Triton 3.6; Llama-3.1-8B projections, x bf16, M=1): int8
2.4-4.4 TB/s of weight bytes, 1.3-1.9x faster than the bf16 ``gemv``; int4 (groups of 128) 1.4-2.9 TB/s,
1.5-2.4x faster than it, the larger matrices (gate_up, LM head) gaining most. At one row int4 is bound by
instruction issue (Nsight Compute, docs/benchmarks.md); from 2 rows of 16-bit x :mod:`rtx_kernels.quant_mma_gemv`
takes int4 to the tensor cores.
"""

from __future__ import annotations

import os

import triton
import triton.language as tl

from rtx_kernels.gemv import _num_sms, reduce_splits, split_count, split_target
from rtx_kernels.pdl import gemv_launch_mode, launch_options, wait_for_previous

MAX_M = 8
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


def choose_split_k(n: int, row_bytes: int, num_sms: int = 132) -> int:
    """Splits of K only when N is too narrow to give every SM an 8-row tile, each split keeping >= 4 KiB a row."""
    return split_count(triton.cdiv(n, 8), num_sms, row_bytes, _MIN_BYTES_PER_SPLIT)


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


def fma_gemv(x, words, scale, zero, bias, out, *, bits: int, group: int, split_k: int | None = None,
             pdl: bool | None = None) -> None:
    """``out = x @ W.T + bias`` for int8 (``bits=8``: ``words`` the int8 weight viewed as int32, ``scale`` [N]) or
    int4 weights (``bits=4``: the packed words, ``scale`` and ``zero`` [N, K/G]), M <= :data:`MAX_M` rows of ``x``
    with unit stride along K; :func:`rtx_kernels.quant_matmul.int8_linear` and ``int4_linear`` check the formats."""
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
