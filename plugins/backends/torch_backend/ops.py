"""The elementwise kernels the decoder's layers call, chosen once per backend: plain torch on the CPU (also the
reference the Triton kernels are tested against) and fused Triton kernels on CUDA."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

Tensor = torch.Tensor


@dataclass(frozen=True, slots=True)
class Ops:
    # (x, weight, eps, residual or None) -> (normalized x + residual, x + residual)
    rms_norm: Callable[[Tensor, Tensor, float, Tensor | None], tuple[Tensor, Tensor]]
    # (q [T, H, D], k [T, KVH, D], positions [T], cos, sin [max_pos, D/2]) -> rotated (q, k), possibly in place
    rotary: Callable[[Tensor, Tensor, Tensor, Tensor, Tensor], tuple[Tensor, Tensor]]
    # [T, 2F] (gate | up) -> [T, F]
    silu_and_mul: Callable[[Tensor], Tensor]
    # (x [T, K], weight [N, K], bias [N] or None) -> [T, N]: the projections inside a layer
    linear: Callable[[Tensor, Tensor, Tensor | None], Tensor] = F.linear
    name: str = "torch"
    # The first and third with their output rounded per row to fp8 e4m3, for an fp8 layer that takes its input so
    # (rms_norm: (values, scales, x + residual); silu_and_mul: (values, scales)); None where there is no fused kernel.
    rms_norm_fp8: Callable[[Tensor, Tensor, float, Tensor | None], tuple[Tensor, Tensor, Tensor]] | None = None
    silu_and_mul_fp8: Callable[[Tensor], tuple[Tensor, Tensor]] | None = None


# Up to this many rows, a projection streams its weight through the Triton GEMV kernel instead of cuBLAS. Measured
# on the H200 (a sweep, docs/benchmarks.md): at one row it beat cuBLAS on every Llama-3.2-1B matrix (qkv 5.2 against
# 6.1 us, o_proj 4.6 / 6.0, down_proj 10.6 / 12.7, LM head 117 / 126); at two or four rows cuBLAS mostly won.
GEMV_MAX_ROWS = 1


def torch_ops() -> Ops:
    from rtx_kernels import reference

    return Ops(reference.rms_norm_ref, reference.apply_rotary_ref, reference.silu_and_mul_ref)


def triton_ops(gemv: bool = True) -> Ops:
    from rtx_kernels.activation import silu_and_mul, silu_and_mul_fp8
    from rtx_kernels.gemv import gemv as gemv_kernel
    from rtx_kernels.rmsnorm import rms_norm, rms_norm_fp8
    from rtx_kernels.rotary import apply_rotary

    def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
        if x.shape[0] <= GEMV_MAX_ROWS:
            return gemv_kernel(x, weight, bias)
        return F.linear(x, weight, bias)

    return Ops(rms_norm, apply_rotary, silu_and_mul, linear if gemv else F.linear, "triton", rms_norm_fp8,
               silu_and_mul_fp8)
