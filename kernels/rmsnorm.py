"""RMSNorm with an optional fused residual add, one program per row, one pass, in Triton.

``x`` is ``[..., N]`` with rows of stride ``N`` after flattening (contiguous last dimension). The results follow the
model's torch RMSNorm step for step, including its roundings: the residual sum is rounded to ``x``'s dtype before
it is normalised, the normalised row is rounded to ``x``'s dtype before the weight multiplies it, and the output
takes torch's promoted dtype of ``weight * x``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from rtx_kernels.pdl import launch_options, pdl_enabled, wait_for_previous


@triton.jit
def _rms_norm_kernel(
    x_ptr, residual_ptr, weight_ptr, out_ptr, residual_out_ptr,
    n_cols, eps,
    HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr, USE_PDL: tl.constexpr,
):
    wait_for_previous(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    offs = row * n_cols + cols
    x = tl.load(x_ptr + offs, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        residual = tl.load(residual_ptr + offs, mask=mask, other=0.0)
        # torch adds 16-bit tensors in fp32 and rounds once; do exactly that.
        x = (x.to(tl.float32) + residual.to(tl.float32)).to(x.dtype)
        tl.store(residual_out_ptr + offs, x, mask=mask)
    xf = x.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(xf * xf, axis=0) / n_cols + eps)
    normed = (xf * rstd).to(x.dtype).to(tl.float32)
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + offs, weight * normed, mask=mask)


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out, residual_out)``; ``residual_out`` is ``x + residual``, or ``x`` itself when ``residual`` is None."""
    n_cols = x.shape[-1]
    x = x.contiguous()
    out = torch.empty(x.shape, dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)
    if residual is not None:
        residual = residual.contiguous()
        residual_out = torch.empty_like(x)
    else:
        residual_out = x
    num_rows = x.numel() // n_cols if n_cols else 0
    if num_rows:
        block = triton.next_power_of_2(n_cols)
        use_pdl = pdl_enabled(x.device)
        _rms_norm_kernel[(num_rows,)](
            x, residual if residual is not None else x, weight, out, residual_out,
            n_cols, eps,
            HAS_RESIDUAL=residual is not None, BLOCK=block, num_warps=min(8, max(1, block // 256)),
            USE_PDL=use_pdl, **launch_options(use_pdl),
        )
    return out, residual_out
