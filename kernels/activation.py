"""SwiGLU's gated activation ``silu(gate) * up`` in Triton.

``x`` is ``[T, 2F]`` with the gate in the first F columns and up in the last F (the fused gate_up projection's
layout); rows may be strided, columns must be contiguous. The output ``[T, F]`` is contiguous, computed in fp32 and
rounded to ``x``'s dtype. The grid is (T, column blocks), so a long row spreads over several programs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from rtx_kernels.pdl import launch_options, pdl_enabled, wait_for_previous

_MAX_BLOCK = 1024


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, stride_xt, num_cols, BLOCK: tl.constexpr, USE_PDL: tl.constexpr):
    wait_for_previous(USE_PDL)
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < num_cols
    gate = tl.load(x_ptr + token * stride_xt + cols, mask=mask, other=0.0)
    up = tl.load(x_ptr + token * stride_xt + num_cols + cols, mask=mask, other=0.0).to(tl.float32)
    g = gate.to(tl.float32)
    tl.store(out_ptr + token * num_cols + cols, (g * tl.sigmoid(g) * up).to(gate.dtype), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """``silu(x[:, :F]) * x[:, F:]`` for ``x`` [T, 2F]; returns a new ``[T, F]`` tensor."""
    num_tokens, width = x.shape
    if width % 2 or x.stride(-1) != 1:
        raise ValueError(f"x {tuple(x.shape)} must have an even, contiguous last dimension")
    num_cols = width // 2
    out = torch.empty(num_tokens, num_cols, dtype=x.dtype, device=x.device)
    if num_tokens and num_cols:
        block = min(_MAX_BLOCK, triton.next_power_of_2(num_cols))
        use_pdl = pdl_enabled(x.device)
        _silu_and_mul_kernel[(num_tokens, triton.cdiv(num_cols, block))](
            x, out, x.stride(0), num_cols, BLOCK=block, USE_PDL=use_pdl, **launch_options(use_pdl))
    return out
