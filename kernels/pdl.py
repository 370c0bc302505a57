"""Programmatic dependent launch (PDL) for the decode path's Triton kernels, on Hopper and later GPUs.

Launched with ``launch_pdl=True``, a kernel may start while the kernel before it on the stream is still running:
its programs become resident as soon as every program of the previous kernel has called
``gdc_launch_dependents`` (or exited), and they stall in ``gdc_wait`` until that kernel has finished and its
writes are visible. Work before the wait overlaps the previous kernel's tail and the launch gap between the two:
the GEMV kernel streams its first weight tile there, since weights are never written by a kernel of the step.

Rules every kernel launched so must follow, or the overlap becomes a race:
- nothing before ``wait`` reads what an earlier kernel of the step may write (activations, the KV cache, the
  block tables) and nothing before it writes any memory at all;
- every program calls ``wait`` (a program that skipped it could finish before its predecessor, and the next
  kernel's wait would then not cover that predecessor).
Kernels launched without PDL (cuBLAS, torch's own) keep the ordinary full dependency, so mixing is safe. CUDA graphs
capture the programmatic edges, so the overlap holds in the decode graphs' replays.

``RTX_PDL=0`` turns it off (read once per process); Triton's interpreter and GPUs before sm_90 never use it.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

from rtxcore import envs


@functools.cache
def _supported(device_index: int) -> bool:
    if os.environ.get("TRITON_INTERPRET") == "1" or not envs.RTX_PDL.get():
        return False
    try:
        from triton.backends.nvidia.compiler import CUDAOptions
    except ImportError:
        return False
    if "launch_pdl" not in getattr(CUDAOptions, "__dataclass_fields__", {}):
        return False
    if not hasattr(tl.extra.cuda, "gdc_wait"):
        return False
    return torch.cuda.get_device_capability(device_index)[0] >= 9


def pdl_enabled(device: torch.device) -> bool:
    """Whether kernels launched on ``device`` use programmatic dependent launch."""
    if device.type != "cuda":
        return False
    return _supported(device.index if device.index is not None else torch.cuda.current_device())


def gemv_launch_mode(device: torch.device, pdl: bool | None) -> tuple[bool, bool]:
    """(prefetch, use_pdl) for a GEMV whose first weight tile may load before the wait: ``pdl`` None follows the
    device; True still prefetches where PDL is off (the interpreter), just without the wait."""
    use_pdl = pdl_enabled(device)
    prefetch = use_pdl if pdl is None else pdl
    return prefetch, use_pdl and prefetch


def launch_options(use_pdl: bool) -> dict:
    """Keyword arguments for a Triton launch: ``launch_pdl`` only when it is used (older Triton lacks it)."""
    return {"launch_pdl": True} if use_pdl else {}


@triton.jit
def wait_for_previous(USE_PDL: tl.constexpr):
    """Wait until the previous kernel on the stream has finished and its writes are visible, then let the next
    kernel's programs launch. A no-op without PDL."""
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
