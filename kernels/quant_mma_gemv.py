"""W4A16 decode GEMV on the tensor cores: ``y = x @ W.T`` for int4 weights in groups of a multiple of 128 columns,
``x`` [M <= 8, K] in bfloat16 or float16, one ``mma.sync.m16n8k16`` per 256 weights.

Why: the FMA GEMV of :mod:`rtx_kernels.quant_fma_gemv` unpacks every weight and multiplies it by every row of x, so
its work grows with M (on the H200, gate_up at 8 rows takes 11x its time at one). Here one shift and one LOP3
turn two weights into a pair of 16-bit floats (the nibbles land in the mantissas under a fixed exponent: 128 + q in
bfloat16, 1024 + q in float16, exact), the tensor cores do the multiplying, and x's rows are the mma's 8 columns:
8 rows cost little more than one. Measured on the H200 (Llama-3.1-8B projections; docs/benchmarks.md, which marks
four figures taken with a configuration since removed): 1.2-1.8x the FMA GEMV's speed at 2 rows, 2.0-3.2x at 4 and
5-10x at 8; at one row a tie or slower (0.68-1.01x), so int4_linear keeps one row on the FMA GEMV (:data:`MIN_M`).

The packed words are read as :mod:`rtx_kernels.quant_reference` stores them (no repacking). A warp owns 16 rows
n0..n0+15 (32 with two tiles) and steps through blocks of 128 columns; lane ``l = 4g + t`` loads 16 bytes (words
4t..4t+3 of the block, columns 32t..32t+31) of row n0+g and of row n0+g+8. The mma wants lane (g, t) to hold its A
tile's columns 2t, 2t+1, 2t+8 and 2t+9. The order of a dot product's terms is free, so each logical column is given
the physical column that makes this hold without moving data between lanes: word j of the lane feeds two mma steps,
its nibble pairs (i, i+4) (one shift and one LOP3 each) being the a-registers, and the lane's B fragment (x's row g,
lanes with g >= M re-reading row M-1) is gathered from the same physical columns with PRMTs. Lane (g, t) gets
back rows n0+g and n0+g+8 of y for x's rows 2t and 2t+1.

Zero point and scale: the mma sums ``(OFFSET + q) * x`` over a block; a second mma with an A of ones hands each lane
the block's sum of x for its two rows of x, and ``s * (sum - (OFFSET + z) * xsum)`` goes into float32 accumulators.
Products of 16-bit floats are exact in the mma's float32, so the offset's cancellation costs a few of float32's
bits, not of x's. The warps of a program take interleaved blocks and are summed at the end; narrow matrices also
split K across programs, reduced as :mod:`rtx_kernels.gemv` does.

Triton's interpreter cannot run PTX, so there the mma step is computed from its definition instead
(:func:`_mma_step_emulated`, the same sums over the same lanes' data); the tests run both, the PTX on the GPU.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

from rtx_kernels.gemv import _num_sms, reduce_splits, split_count, split_target
from rtx_kernels.pdl import gemv_launch_mode, launch_options, wait_for_previous

BLOCK_COLUMNS = 128
MAX_M = 8
# The fewest rows of x int4_linear sends here by default: at one row the FMA GEMV tied on qkv and was faster on
# the other projections on the H200 (qkv 7.87 against 7.76 us, o_proj 4.89 against 7.20, gate_up 24.25 against
# 24.83, down_proj 14.57 against 15.64); from two rows on this kernel was faster on every projection.
MIN_M = 2
_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
_USE_PTX = tl.constexpr(not _INTERPRET)
_OFFSET = {torch.bfloat16: 128.0, torch.float16: 1024.0}


def _step_asm(kind: str, tiles: int) -> str:
    """One word of each of the lane's 2 * ``tiles`` rows times 8 columns of x: per tile of 16 rows two mma steps
    into its D from its C, and the same two steps with an A of ones into the sums of x.

    Operands, outputs first: the tiles' D (4 each), the sums' D (4); then the words of rows g, g+8 (, g+16, g+24),
    the four words of x (columns 0-1, 2-3, 4-5, 6-7 of the word's 8), the tiles' C, the sums' C. Every input is
    read before any output is written, so outputs may share registers with inputs.
    """
    magic = "0x43004300" if kind == "bf16" else "0x64006400"
    one = "0x3F803F80" if kind == "bf16" else "0x3C003C00"
    mma = f"mma.sync.aligned.m16n8k16.row.col.f32.{kind}.{kind}.f32"
    words = 4 * tiles + 4
    x = words + 2 * tiles
    c = x + 4
    lines = ["{", ".reg .b32 sh, b<4>, one, " + ", ".join(f"w{r}_<4>" for r in range(2 * tiles)) + ";",
             ".reg .f32 " + ", ".join(f"d{i}_<4>" for i in range(tiles + 1)) + ";"]
    for r in range(2 * tiles):
        for i in range(4):
            if i:
                lines.append(f"shr.u32 sh, ${words + r}, {4 * i};")
            lines.append(f"lop3.b32 w{r}_{i}, {'sh' if i else f'${words + r}'}, 0x000F000F, {magic}, 0xEA;")
    # (x0, x4), (x1, x5), (x2, x6), (x3, x7): the columns of nibble pairs (0, 4), (1, 5), (2, 6), (3, 7).
    lines += [f"prmt.b32 b0, ${x}, ${x + 2}, 0x5410;", f"prmt.b32 b1, ${x}, ${x + 2}, 0x7632;",
              f"prmt.b32 b2, ${x + 1}, ${x + 3}, 0x5410;", f"prmt.b32 b3, ${x + 1}, ${x + 3}, 0x7632;",
              f"mov.b32 one, {one};"]
    for tile in range(tiles + 1):
        d = "{" + ", ".join(f"d{tile}_{i}" for i in range(4)) + "}"
        c_in = "{" + ", ".join(f"${c + 4 * tile + i}" for i in range(4)) + "}"
        if tile < tiles:
            lo, hi = f"w{2 * tile}_", f"w{2 * tile + 1}_"
            a0, a1 = f"{{{lo}0, {hi}0, {lo}1, {hi}1}}", f"{{{lo}2, {hi}2, {lo}3, {hi}3}}"
        else:
            a0 = a1 = "{one, one, one, one}"
        lines += [f"{mma} {d}, {a0}, {{b0, b1}}, {c_in};", f"{mma} {d}, {a1}, {{b2, b3}}, {d};"]
    lines += [f"mov.f32 ${4 * tile + i}, d{tile}_{i};" for tile in range(tiles + 1) for i in range(4)]
    return "\n".join(lines + ["}"])


_ASM_BF16_1 = tl.constexpr(_step_asm("bf16", 1))
_ASM_BF16_2 = tl.constexpr(_step_asm("bf16", 2))
_ASM_F16_1 = tl.constexpr(_step_asm("f16", 1))
_ASM_F16_2 = tl.constexpr(_step_asm("f16", 2))
_CONSTRAINTS_1 = tl.constexpr(",".join(["=f"] * 8 + ["r"] * 6 + ["f"] * 8))
_CONSTRAINTS_2 = tl.constexpr(",".join(["=f"] * 12 + ["r"] * 8 + ["f"] * 12))


@triton.jit
def _halves(words, IS_BF16: tl.constexpr):
    """int32 words holding two 16-bit floats -> the low and the high one, as float32."""
    if IS_BF16:
        return (words << 16).to(tl.float32, bitcast=True), (words & -65536).to(tl.float32, bitcast=True)
    else:
        lo = (words & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
        hi = ((words >> 16) & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
        return lo, hi


@triton.jit
def _lane_pairs(v, WARPS: tl.constexpr):
    """[WARPS, 8 (g), 8 (m)] -> the values lane (g, t) holds of columns 2t and 2t + 1, each [WARPS * 32]."""
    a, b = tl.split(tl.reshape(v, [WARPS, 8, 4, 2]))
    return tl.reshape(a, [WARPS * 32]), tl.reshape(b, [WARPS * 32])


@triton.jit
def _mma_step_emulated(wg, wg8, x0, x1, x2, x3, c0, c1, c2, c3, s0, s1, s2, s3,
                       IS_BF16: tl.constexpr, OFFSET: tl.constexpr, WARPS: tl.constexpr):
    """What the PTX step computes, from its definition: D[row][m] += sum over the lanes t' of row's group and the
    word's 8 columns of (OFFSET + q) * x[m], and the sums of x, laid out as the mma's D fragment."""
    nib = tl.arange(0, 8)[None, :]
    ag = ((wg[:, None] >> (4 * nib)) & 0xF).to(tl.float32) + OFFSET  # [WARPS * 32 lanes, 8 columns]
    ag8 = ((wg8[:, None] >> (4 * nib)) & 0xF).to(tl.float32) + OFFSET
    xv = tl.zeros([WARPS * 32, 8], tl.float32)
    for i in tl.static_range(4):
        word = x0 if i == 0 else x1 if i == 1 else x2 if i == 2 else x3
        lo, hi = _halves(word, IS_BF16)
        xv = tl.where(nib == 2 * i, lo[:, None], tl.where(nib == 2 * i + 1, hi[:, None], xv))
    x4 = tl.reshape(xv, [WARPS, 1, 8, 32])  # [WARPS, -, m, (t', column)]
    d = tl.sum(tl.reshape(ag, [WARPS, 8, 1, 32]) * x4, axis=3)  # [WARPS, g, m]
    d8 = tl.sum(tl.reshape(ag8, [WARPS, 8, 1, 32]) * x4, axis=3)
    xs = tl.broadcast_to(tl.sum(x4, axis=3), [WARPS, 8, 8])
    d0, d1 = _lane_pairs(d, WARPS)
    d2, d3 = _lane_pairs(d8, WARPS)
    e0, e1 = _lane_pairs(xs, WARPS)
    return c0 + d0, c1 + d1, c2 + d2, c3 + d3, s0 + e0, s1 + e1, s2 + e0, s3 + e1


@triton.jit
def _mma_step(w0, w1, w2, w3, x0, x1, x2, x3, c, xs,
              IS_BF16: tl.constexpr, OFFSET: tl.constexpr, WARPS: tl.constexpr, TILES: tl.constexpr):
    """c (8: 4 per tile, the second tile's unused with one) and xs (4) after one word of rows g, g+8 (and with two
    tiles g+16, g+24), returned as one tuple of 12: see _step_asm."""
    if _USE_PTX:
        if TILES == 1:
            d0, d1, d2, d3, e0, e1, e2, e3 = tl.inline_asm_elementwise(
                _ASM_BF16_1 if IS_BF16 else _ASM_F16_1, _CONSTRAINTS_1,
                [w0, w1, x0, x1, x2, x3, c[0], c[1], c[2], c[3], xs[0], xs[1], xs[2], xs[3]],
                dtype=(tl.float32,) * 8, is_pure=True, pack=1)
            return d0, d1, d2, d3, c[4], c[5], c[6], c[7], e0, e1, e2, e3
        else:
            return tl.inline_asm_elementwise(
                _ASM_BF16_2 if IS_BF16 else _ASM_F16_2, _CONSTRAINTS_2,
                [w0, w1, w2, w3, x0, x1, x2, x3, c[0], c[1], c[2], c[3], c[4], c[5], c[6], c[7],
                 xs[0], xs[1], xs[2], xs[3]],
                dtype=(tl.float32,) * 12, is_pure=True, pack=1)
    else:
        d0, d1, d2, d3, e0, e1, e2, e3 = _mma_step_emulated(w0, w1, x0, x1, x2, x3, c[0], c[1], c[2], c[3], xs[0],
                                                            xs[1], xs[2], xs[3], IS_BF16, OFFSET, WARPS)
        if TILES == 1:
            return d0, d1, d2, d3, c[4], c[5], c[6], c[7], e0, e1, e2, e3
        else:
            d4, d5, d6, d7, _, _, _, _ = _mma_step_emulated(w2, w3, x0, x1, x2, x3, c[4], c[5], c[6], c[7], xs[0],
                                                            xs[1], xs[2], xs[3], IS_BF16, OFFSET, WARPS)
            return d0, d1, d2, d3, d4, d5, d6, d7, e0, e1, e2, e3


@triton.jit
def _words(t, i: tl.constexpr):
    """Word i of each lane's 4 ([WARPS * 32, 4] -> [WARPS * 32]; in-thread, no data moves)."""
    a0, a1 = tl.split(tl.reshape(t, [t.shape[0], 2, 2]))
    if i == 0:
        return tl.split(a0)[0]
    elif i == 1:
        return tl.split(a1)[0]
    elif i == 2:
        return tl.split(a0)[1]
    else:
        return tl.split(a1)[1]


@triton.jit
def _load_weights(w_ptrs, s_ptrs, z_ptrs, block, b_hi, GROUP: tl.constexpr, EVEN: tl.constexpr):
    """Each warp's block of one of the lane's rows: the 4 words, and the block's scale and zero point."""
    grp = block * 128 // GROUP
    if EVEN:
        mask, mask2, nothing = None, None, None
    else:
        mask, mask2, nothing = block < b_hi, (block < b_hi)[:, None], 0
    return (tl.load(w_ptrs + (16 * block)[:, None], mask=mask2, other=nothing),
            tl.load(s_ptrs + grp, mask=mask, other=nothing), tl.load(z_ptrs + grp, mask=mask, other=nothing))


@triton.jit
def _load_block(w_ptrs, s_ptrs, z_ptrs, block, b_hi, GROUP: tl.constexpr, EVEN: tl.constexpr, TILES: tl.constexpr):
    """The weights of the lane's 2 * TILES rows, each (words, scale, zero point)."""
    r0 = _load_weights(w_ptrs[0], s_ptrs[0], z_ptrs[0], block, b_hi, GROUP, EVEN)
    r1 = _load_weights(w_ptrs[1], s_ptrs[1], z_ptrs[1], block, b_hi, GROUP, EVEN)
    if TILES == 1:
        return r0, r1, r0, r1
    else:
        return (r0, r1, _load_weights(w_ptrs[2], s_ptrs[2], z_ptrs[2], block, b_hi, GROUP, EVEN),
                _load_weights(w_ptrs[3], s_ptrs[3], z_ptrs[3], block, b_hi, GROUP, EVEN))


@triton.jit
def _load_x(x_ptrs, block, b_hi, EVEN: tl.constexpr):
    """x's 64 words of each warp's block that the lane's B fragments take: 4 vectors, one per word of weights."""
    at = x_ptrs + (64 * block)[:, None]
    if EVEN:
        mask, nothing = None, None
    else:
        mask, nothing = (block < b_hi)[:, None], 0
    return (tl.load(at, mask=mask, other=nothing), tl.load(at + 4, mask=mask, other=nothing),
            tl.load(at + 8, mask=mask, other=nothing), tl.load(at + 12, mask=mask, other=nothing))


def _config(warps: int, tiles: int) -> triton.Config:
    return triton.Config({"WARPS": warps, "TILES": tiles}, num_warps=warps, num_stages=1)


_GPU_CONFIGS = [_config(w, t) for t in (1, 2) for w in (2, 4, 8)]
_INTERPRETER_CONFIGS = [_config(2, 2)]


@triton.autotune(configs=_INTERPRETER_CONFIGS if _INTERPRET else _GPU_CONFIGS,
                 key=["N", "NUM_BLOCKS", "M_BUCKET", "SPLIT_K", "GROUP", "IS_BF16", "PREFETCH"])
@triton.heuristics({"EVEN": lambda a: a["NUM_BLOCKS"] % (a["SPLIT_K"] * a["WARPS"]) == 0})
@triton.jit
def _mma_gemv_kernel(
    x_ptr, w_ptr, scale_ptr, zero_ptr, bias_ptr, out_ptr,
    M, N, NUM_BLOCKS,
    stride_xm, stride_wn, stride_sn, stride_om, stride_os,
    M_BUCKET,  # only an autotuning key
    GROUP: tl.constexpr, IS_BF16: tl.constexpr, HAS_BIAS: tl.constexpr, SPLIT_K: tl.constexpr,
    PREFETCH: tl.constexpr, USE_PDL: tl.constexpr, WARPS: tl.constexpr, TILES: tl.constexpr, EVEN: tl.constexpr,
):
    OFFSET: tl.constexpr = 128.0 if IS_BF16 else 1024.0
    LANES: tl.constexpr = WARPS * 32
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    # Every per-lane value is a [WARPS * 32] tensor, element 32w + l on lane l of warp w: the mma's fragments are
    # per lane, so this must be the tensors' layout, and it is the layout Triton gives a 1-D tensor of one element
    # a thread and the [WARPS * 32, 4] loads below (16 bytes a thread). A layout that mixed the warps' and lanes'
    # elements would make the results wrong, which the GPU tests would catch.
    idx = tl.arange(0, LANES)
    warp = idx // 32
    g = idx % 32 // 4
    t = idx % 4
    first_row = pid_n * 16 * TILES + g
    # Past-the-end rows re-read row N-1 and lanes past M re-read x's row M-1; their results are not stored.
    r0 = tl.minimum(first_row, N - 1)
    r1 = tl.minimum(first_row + 8, N - 1)
    r2 = tl.minimum(first_row + 16, N - 1)
    r3 = tl.minimum(first_row + 24, N - 1)
    xr = tl.minimum(g, M - 1)
    blocks_per_split = tl.cdiv(NUM_BLOCKS, SPLIT_K)
    b_lo = pid_k * blocks_per_split
    b_hi = tl.minimum(b_lo + blocks_per_split, NUM_BLOCKS)

    lane_words = (4 * t)[:, None] + tl.arange(0, 4)[None, :]
    w_ptrs = (w_ptr + r0.to(tl.int64)[:, None] * stride_wn + lane_words,
              w_ptr + r1.to(tl.int64)[:, None] * stride_wn + lane_words,
              w_ptr + r2.to(tl.int64)[:, None] * stride_wn + lane_words,
              w_ptr + r3.to(tl.int64)[:, None] * stride_wn + lane_words)
    s_ptrs = (scale_ptr + r0 * stride_sn, scale_ptr + r1 * stride_sn, scale_ptr + r2 * stride_sn,
              scale_ptr + r3 * stride_sn)
    z_ptrs = (zero_ptr + r0 * stride_sn, zero_ptr + r1 * stride_sn, zero_ptr + r2 * stride_sn,
              zero_ptr + r3 * stride_sn)
    x_ptrs = x_ptr + (xr * stride_xm + 16 * t)[:, None] + tl.arange(0, 4)[None, :]

    zeros = tl.zeros([LANES], tl.float32)
    y = (zeros, zeros, zeros, zeros, zeros, zeros, zeros, zeros)
    # The weights of the first blocks are loaded before waiting for the previous kernel (as in the FMA GEMV),
    # x only after it: x is what that kernel writes.
    if not PREFETCH:
        wait_for_previous(USE_PDL)
    block = b_lo + warp
    rows = _load_block(w_ptrs, s_ptrs, z_ptrs, block, b_hi, GROUP, EVEN, TILES)
    if PREFETCH:
        wait_for_previous(USE_PDL)
    xs = _load_x(x_ptrs, block, b_hi, EVEN)
    for b0 in tl.range(b_lo, b_hi, WARPS, num_stages=1):
        block = b0 + warp
        if EVEN:
            # The last step re-reads its own blocks instead of ones past the split.
            next_block = tl.minimum(block + WARPS, b_hi - WARPS + warp)
        else:
            next_block = block + WARPS
        next_rows = _load_block(w_ptrs, s_ptrs, z_ptrs, next_block, b_hi, GROUP, EVEN, TILES)
        next_xs = _load_x(x_ptrs, next_block, b_hi, EVEN)
        y = _block_sums(y, rows, xs, IS_BF16, OFFSET, WARPS, TILES)
        rows = next_rows
        xs = next_xs

    # Lane (g, t) holds rows g + 8i for x's rows 2t and 2t+1; the warps' sums add up.
    lane = tl.arange(0, 32)
    first_out = pid_n * 16 * TILES + lane // 4
    m0 = 2 * (lane % 4)
    out = out_ptr + pid_k * stride_os
    for i in tl.static_range(4 * TILES):
        total = tl.sum(tl.reshape(y[i], [WARPS, 32]), axis=0)
        n = first_out + 8 * (i // 2)
        m = m0 + (i % 2)
        if HAS_BIAS and SPLIT_K == 1:
            total += tl.load(bias_ptr + tl.minimum(n, N - 1)).to(tl.float32)
        tl.store(out + m * stride_om + n, total.to(out_ptr.dtype.element_ty), mask=(m < M) & (n < N))


@triton.jit
def _block_sums(y, rows, xs, IS_BF16: tl.constexpr, OFFSET: tl.constexpr, WARPS: tl.constexpr,
                TILES: tl.constexpr):
    """y (lane's D values: rows g, g, g+8, g+8, then g+16, ... for x's rows 2t, 2t+1) plus one block's terms."""
    zeros = tl.zeros([WARPS * 32], tl.float32)
    c = (zeros, zeros, zeros, zeros, zeros, zeros, zeros, zeros)
    s = (zeros, zeros, zeros, zeros)
    for j in tl.static_range(4):
        xj = xs[j]
        d = _mma_step(_words(rows[0][0], j), _words(rows[1][0], j), _words(rows[2][0], j), _words(rows[3][0], j),
                      _words(xj, 0), _words(xj, 1), _words(xj, 2), _words(xj, 3),
                      c, s, IS_BF16, OFFSET, WARPS, TILES)
        c = (d[0], d[1], d[2], d[3], d[4], d[5], d[6], d[7])
        s = (d[8], d[9], d[10], d[11])
    # sum_k (q - z) s x = s * (sum_k (OFFSET + q) x - (OFFSET + z) sum_k x), per row and row of x.
    out = ()
    for i in tl.static_range(8):
        if i < 4 * TILES:
            _, scale, zero = rows[i // 2]
            out = out + (y[i] + scale * (c[i] - (zero.to(tl.float32) + OFFSET) * s[i % 2]),)
        else:
            out = out + (y[i],)
    return out


REQUIREMENTS = ("bfloat16 or float16 x of at most 8 rows, K and the group size multiples of 128, x's rows whole "
                "4-byte-aligned 32-bit words, and a GPU of compute capability 8.0 or later")


def fits(x: torch.Tensor, group_size: int) -> bool:
    """Whether :func:`int4_mma_gemv` takes this product (:data:`REQUIREMENTS`)."""
    return (x.dtype in _OFFSET and x.shape[0] <= MAX_M and group_size % BLOCK_COLUMNS == 0
            and x.shape[1] > 0 and x.shape[1] % BLOCK_COLUMNS == 0 and x.stride(1) == 1 and x.stride(0) % 2 == 0
            and x.storage_offset() % 2 == 0 and x.data_ptr() % 4 == 0
            and (not x.is_cuda or _has_mma(x.device.index or 0)))


@functools.cache
def _has_mma(device_index: int) -> bool:
    # mma.sync.m16n8k16 on 16-bit floats came with Ampere.
    return torch.cuda.get_device_capability(device_index) >= (8, 0)


def choose_split_k(n: int, num_blocks: int, num_sms: int = 132) -> int:
    """Splits of K only while the 16-row tiles number fewer than two per SM, each split keeping >= 8 blocks."""
    return split_count(triton.cdiv(n, 16), 2 * num_sms, num_blocks, 8)


def int4_mma_gemv(x, packed, scale, zero, group_size: int, bias, out, *, split_k: int | None = None,
                  pdl: bool | None = None) -> None:
    """``out = x @ W.T + bias`` (see :func:`rtx_kernels.quant_matmul.int4_linear` for the formats, which checks
    them); :func:`fits` must hold for ``x``."""
    m, k = x.shape
    n = packed.shape[0]
    num_blocks = k // BLOCK_COLUMNS
    if split_k is None:
        split_k = choose_split_k(n, num_blocks, _num_sms(x.device.index or 0) if x.is_cuda else 132)
    prefetch, use_pdl = gemv_launch_mode(x.device, pdl)
    target, stride_om, stride_os = split_target(out, split_k)
    x_words = x.view(torch.int32)  # pairs of columns: fits() asks for an even row stride
    _mma_gemv_kernel[lambda meta: (triton.cdiv(n, 16 * meta["TILES"]), split_k)](
        x_words, packed, scale, zero, bias if bias is not None else scale, target,
        m, n, num_blocks,
        x.stride(0) // 2, packed.stride(0), scale.stride(0), stride_om, stride_os,
        triton.next_power_of_2(m),
        GROUP=group_size, IS_BF16=x.dtype == torch.bfloat16, HAS_BIAS=bias is not None, SPLIT_K=split_k,
        PREFETCH=prefetch, USE_PDL=use_pdl, **launch_options(use_pdl),
    )
    reduce_splits(target, bias, out, split_k, use_pdl)
