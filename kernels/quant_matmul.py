"""``y = x @ W.T (+ bias)`` with W stored as int8 or int4 (weight-only quantization), in Triton.

The formats are those of :mod:`rtx_kernels.quant_reference`: int8 per output channel (``weight`` int8 [N, K],
``scale`` [N]) and int4 in asymmetric groups along K (``packed`` int32 [N, K/8], ``scale`` [N, K/G], ``zero``
uint8 [N, K/G]). ``x`` is [M, K] in float32, float16 or bfloat16; the output takes its dtype.

Decode (M <= 8) runs a GEMV bound by reading the weight once: :mod:`rtx_kernels.quant_fma_gemv` on the FMA units,
or, for int4 with 2 to 8 rows of 16-bit x, :mod:`rtx_kernels.quant_mma_gemv` on the tensor cores.

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

import functools
import os

import torch
import triton
import triton.language as tl

from rtx_kernels import quant_fma_gemv, quant_mma_gemv
from rtx_kernels.quant_dequantize import dequantize_int4_tile, dequantized_matmul
from rtxcore import envs

# From this many rows of x on (by bits), dequantize to scratch and use cuBLAS (see the module docstring). Measured
# with a sweep, docs/benchmarks.md on the H200 at Llama-3.1-8B's projections (M = 16, 64, 256): the int4 GEMM lost
# to it at every M from 16 on but one (gate_up at 64: 136 against 162 us); the int8 GEMM won at 16 and 64 rows and
# broke even at 256 (367 against 356 us over the four projections). 128 for int8 lies between, not measured.
DEQUANTIZE_MIN_M = {4: 9, 8: 128}
KERNELS = ("gemv", "mma", "gemm", "dequantize")
_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


@functools.cache
def _int4_mma_enabled() -> bool:
    """Whether int4 decode products of 2 to 8 rows of 16-bit x, with groups of whole 128-column blocks, run on the
    tensor cores (rtx_kernels.quant_mma_gemv); RTX_INT4_MMA=0 sends them to the FMA GEMV instead (A/B measurements).

    Read at the first product and kept: this runs for every projection of every step.
    """
    return envs.RTX_INT4_MMA.get()


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

    :param split_k: splits of K for the GEMV; :func:`rtx_kernels.quant_fma_gemv.choose_split_k` when None.
        Results depend on it in the last bits.
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
        quant_fma_gemv.fma_gemv(x, weight.view(torch.int32), scale, scale, bias, out, bits=8, group=0,
                                split_k=split_k, pdl=pdl)
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
    if (kernel is None and _int4_mma_enabled() and quant_mma_gemv.MIN_M <= m <= quant_mma_gemv.MAX_M
            and quant_mma_gemv.fits(x, group_size)):
        kernel = "mma"
    elif kernel == "mma" and not quant_mma_gemv.fits(x, group_size):
        raise ValueError(f"the tensor-core GEMV ('mma') takes {quant_mma_gemv.REQUIREMENTS}; got x "
                         f"{tuple(x.shape)} {x.dtype} with strides {x.stride()}, group_size={group_size}")
    kernel = _choose_kernel(kernel, m, bits=4, gemv_fits=True)
    if kernel == "mma":
        quant_mma_gemv.int4_mma_gemv(x, packed, scale, zero, group_size, bias, out, split_k=split_k, pdl=pdl)
    elif kernel == "gemv":
        quant_fma_gemv.fma_gemv(x, packed, scale, zero, bias, out, bits=4, group=group_size, split_k=split_k, pdl=pdl)
    elif kernel == "gemm":
        _gemm(x, packed, scale, zero, bias, out, bits=4, group=group_size)
    else:
        dequantized_matmul(x, packed, scale, zero, bias, out, bits=4, group=group_size)
    return out


def _choose_kernel(kernel: str | None, m: int, bits: int, gemv_fits: bool) -> str:
    if kernel is None:
        return ("gemv" if m <= quant_fma_gemv.MAX_M and gemv_fits else
                "gemm" if m < DEQUANTIZE_MIN_M[bits] else "dequantize")
    if kernel not in KERNELS:
        raise ValueError(f"kernel {kernel!r} is not one of {KERNELS}")
    if kernel == "mma":
        return kernel
    if kernel == "gemv" and not (m <= quant_fma_gemv.MAX_M and gemv_fits):
        raise ValueError(f"the GEMV kernel takes at most {quant_fma_gemv.MAX_M} rows of whole 32-bit words; got M={m}")
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
