"""C++ CPU kernels, compiled on first use with torch's extension builder and cached between runs.

Compiling needs a C++ compiler and ninja; when either is missing, or ``RTX_CPU_KERNELS=0``, callers fall back
to their pure-torch path. The build happens once per machine (about a minute on two cores) and is reused from
torch's extension cache afterwards.
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path
from typing import Callable

from rtxcore import envs

log = logging.getLogger("rtx.kernels")

_SOURCE = Path(__file__).with_name("cpu") / "paged_decode.cpp"
_lock = threading.Lock()
_kernel: Callable | None = None
_tried = False


def paged_decode_kernel() -> Callable | None:
    """The fused paged decode attention ``f(q, k_cache, v_cache, block_tables, seq_lens, scale)``, or None."""
    global _kernel, _tried
    with _lock:
        if _tried:
            return _kernel
        _tried = True
        if not envs.RTX_CPU_KERNELS.get():
            return None
        try:
            from torch.utils.cpp_extension import load

            module = load(
                name="rtx_cpu_paged_decode",
                sources=[str(_SOURCE)],
                extra_cflags=["-O3", "-march=native", "-fopenmp"],
                extra_ldflags=["-fopenmp"],
                verbose=False,
            )
            _kernel = module.paged_decode_attention
        except Exception as exc:  # no compiler, no ninja, or a build error: the torch path still works
            log.warning("CPU decode-attention kernel unavailable, using the torch path: %s", exc)
            _kernel = None
        return _kernel
