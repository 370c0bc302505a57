"""Repeated launches of one Triton kernel specialization without going through Triton's dispatch each time.

A step that carries prefill tokens launches attention eagerly once per layer (a sweep, docs/benchmarks.md; everything
else replays from piecewise CUDA graphs), with arguments that differ from layer to layer only in which layer's KV
cache they point at. Triton's dispatch binds and specializes every argument and looks the compiled kernel up again
on each call, and on the H200 machine's host a wrapper call cost 60-75 us (third session of docs/benchmarks.md),
enough to leave the GPU waiting in those steps. With a ``cache`` dict that lives for one step, the first launch of a
given specialization goes through Triton and keeps the compiled kernel; later ones call it directly.

The cache key holds the constexprs, the launch options and everything Triton specializes on: each non-tensor
argument's value (integers are specialized on == 1 and on divisibility by 16) and each tensor's dtype and 16-byte
alignment, so a later launch reuses a compiled
kernel only where Triton itself would have picked the same one. Constexpr arguments must come after all the others
in the kernel's signature, as in every kernel here.
"""

from __future__ import annotations

from typing import Any

import torch


def launch(kernel, grid: tuple[int, ...], args: tuple, constexprs: dict[str, Any], options: dict[str, Any],
           cache: dict | None) -> None:
    """``kernel[grid](*args, **constexprs, **options)``, reusing the compiled kernel kept in ``cache`` when the same
    specialization was launched before (``cache`` None: always through Triton)."""
    if cache is None:
        kernel[grid](*args, **constexprs, **options)
        return
    key = (kernel, *constexprs.values(), *options.values(), *_arg_keys(kernel, args))
    hit = cache.get(key)
    if hit is not None:
        compiled, tail = hit
        # The compiled kernel's launcher reads three grid dimensions, whatever the kernel uses.
        compiled[(*grid, 1, 1)[:3]](*args, *tail)
        return
    compiled = kernel[grid](*args, **constexprs, **options)
    # The interpreter returns no compiled kernel: nothing to keep.
    if compiled is not None and hasattr(compiled, "function"):
        cache[key] = (compiled, tuple(constexprs[name] for name in kernel.arg_names[len(args):]))


def _arg_keys(kernel, args: tuple):
    """What Triton specializes on, per argument: a tensor's dtype and 16-byte alignment (dtype alone where the
    kernel opts out of alignment), an integer's value (only its range's type where the kernel opts out with
    do_not_specialize, so that a count that differs every call still finds its compiled kernel)."""
    params = getattr(kernel, "params", None)  # the interpreter's kernels have none, and nothing is cached for them
    for i, a in enumerate(args):
        param = params[i] if params is not None else None
        if isinstance(a, torch.Tensor):
            yield (a.dtype,) if param is not None and param.do_not_specialize_on_alignment else (
                a.dtype, a.data_ptr() % 16 == 0)
        elif param is not None and param.do_not_specialize and type(a) is int:
            # Triton still types the argument by its range.
            yield "i32" if -2**31 <= a < 2**31 else "i64" if -2**63 <= a < 2**63 else "u64"
        else:
            yield a
