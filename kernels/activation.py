"""SwiGLU's gated activation ``silu(gate) * up`` in Triton.

``x`` is ``[T, 2F]`` with the gate in the first F columns and up in the last F (the fused gate_up projection's
layout); rows may be strided, columns must be contiguous. The output ``[T, F]`` is contiguous, computed in fp32 and
rounded to ``x``'s dtype. The grid is (T, column blocks), so a long row spreads over several programs.

``silu_and_mul_fp8`` rounds that output per row to fp8 e4m3 as the fp8 quantizer rounds a linear layer's input
(``rtx_kernels.quant_rows``), for the down projection: the same bytes and scales as the two kernels in a row, in one
launch. It needs the whole row's maximum, so a program owns a row: up to 16,384 columns held in registers, longer
rows in tiles, read a second time (from L2) once the maximum is known.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from rtx_kernels.pdl import launch_options, pdl_enabled, wait_for_previous
from rtx_kernels.quant_rows import FP8, FP8_LEVELS, ONE_PASS_MAX_K, quantize_values, row_scale, row_warps

_MAX_BLOCK = 1024
# Longer rows: tiles of 2048 with 16 warps, the best of 1024-4096 and 4-16 warps at llama-8b's width on an H100
# (12.4 us at 256 rows against 11.9 in one pass and 13.5 for the two kernels; docs/benchmarks.md).
_FP8_TILE = 2048
_FP8_WARPS = 16


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, stride_xt, num_cols, BLOCK: tl.constexpr, USE_PDL: tl.constexpr):
    wait_for_previous(USE_PDL)
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    tl.store(out_ptr + token * num_cols + cols, _silu_mul_tile(x_ptr + token * stride_xt, cols, num_cols),
             mask=cols < num_cols)


@triton.jit
def _silu_and_mul_fp8_kernel(x_ptr, q_ptr, scale_ptr, stride_xt, num_cols, BLOCK: tl.constexpr,
                             ONE_PASS: tl.constexpr, USE_PDL: tl.constexpr):
    wait_for_previous(USE_PDL)
    token = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    x_row = x_ptr + token * stride_xt
    if ONE_PASS:  # the whole row in registers
        y = _silu_mul_tile(x_row, cols, num_cols).to(tl.float32)
        scale = row_scale(tl.abs(y), (y != y).to(tl.int32), FP8_LEVELS)
        tl.store(scale_ptr + token, scale)
        tl.store(q_ptr + token * num_cols + cols, quantize_values(y, scale, FP8_LEVELS, False), mask=cols < num_cols)
    else:  # tiles: a pass for the maximum, a second (reading the row back from L2) for the values
        amax = tl.zeros([BLOCK], tl.float32)
        nans = tl.zeros([BLOCK], tl.int32)
        for c0 in range(0, num_cols, BLOCK):
            y = _silu_mul_tile(x_row, c0 + cols, num_cols).to(tl.float32)
            amax = tl.maximum(amax, tl.abs(y))
            nans += (y != y).to(tl.int32)
        scale = row_scale(amax, nans, FP8_LEVELS)
        tl.store(scale_ptr + token, scale)
        for c0 in range(0, num_cols, BLOCK):
            y = _silu_mul_tile(x_row, c0 + cols, num_cols).to(tl.float32)
            tl.store(q_ptr + token * num_cols + c0 + cols, quantize_values(y, scale, FP8_LEVELS, False),
                     mask=c0 + cols < num_cols)


@triton.jit
def _silu_mul_tile(x_row, cols, num_cols):
    """silu(gate) * up over ``cols``, computed in float32 and rounded to x's dtype (what silu_and_mul stores and the
    fp8 variant rounds further); 0 past the row."""
    mask = cols < num_cols
    gate = tl.load(x_row + cols, mask=mask, other=0.0)
    up = tl.load(x_row + num_cols + cols, mask=mask, other=0.0).to(tl.float32)
    g = gate.to(tl.float32)
    return (g * tl.sigmoid(g) * up).to(gate.dtype)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """``silu(x[:, :F]) * x[:, F:]`` for ``x`` [T, 2F]; returns a new ``[T, F]`` tensor."""
    num_cols = _check(x)
    num_tokens = x.shape[0]
    out = torch.empty(num_tokens, num_cols, dtype=x.dtype, device=x.device)
    if num_tokens and num_cols:
        block = min(_MAX_BLOCK, triton.next_power_of_2(num_cols))
        use_pdl = pdl_enabled(x.device)
        _silu_and_mul_kernel[(num_tokens, triton.cdiv(num_cols, block))](
            x, out, x.stride(0), num_cols, BLOCK=block, USE_PDL=use_pdl, **launch_options(use_pdl))
    return out


def silu_and_mul_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q, scale)``: :func:`silu_and_mul`'s output rounded per row to fp8 e4m3 (``q`` [T, F], ``scale`` float32
    [T, 1]), bit for bit what ``quantize_rows_fp8`` makes of it."""
    num_cols = _check(x)
    num_tokens = x.shape[0]
    q = torch.empty(num_tokens, num_cols, dtype=torch.uint8, device=x.device)
    scale = torch.empty(num_tokens, 1, dtype=torch.float32, device=x.device)
    if num_tokens and num_cols:
        one_pass = num_cols <= ONE_PASS_MAX_K  # llama-8b's 14,336 columns fit
        block = triton.next_power_of_2(num_cols) if one_pass else _FP8_TILE
        use_pdl = pdl_enabled(x.device)
        _silu_and_mul_fp8_kernel[(num_tokens,)](
            x, q, scale, x.stride(0), num_cols, BLOCK=block, ONE_PASS=one_pass, USE_PDL=use_pdl,
            num_warps=row_warps(block) if one_pass else _FP8_WARPS, **launch_options(use_pdl))
    return q.view(FP8), scale


def _check(x: torch.Tensor) -> int:
    """F, the output's width, for ``x`` [T, 2F] with contiguous columns."""
    if x.dim() != 2 or x.shape[1] % 2 or x.stride(-1) != 1:
        raise ValueError(f"x {tuple(x.shape)} must be [T, 2F] with an even, contiguous last dimension")
    return x.shape[1] // 2
