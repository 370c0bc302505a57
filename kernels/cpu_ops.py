"""C++ CPU kernels, compiled once with torch's extension builder and cached between runs.

Compiling needs a C++ compiler and ninja; when either is missing, or ``RTX_CPU_KERNELS=0``, callers fall back
to their pure-torch path. The build (about a minute on two cores) goes to a folder of its own per torch version,
Python ABI, source, flags and CPU (:func:`build_directory`), not to torch's default cache, which is keyed by Python
version only: two environments on one machine with different torch builds would otherwise rebuild it each time they
alternate. ``scripts/setup.sh`` builds it during set-up, so the first ``rtx generate`` does not.
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import sys
import threading
from pathlib import Path
from typing import Callable

from rtxcore import envs

log = logging.getLogger("rtx.kernels")

_SOURCE = Path(__file__).with_name("cpu") / "paged_decode.cpp"
_NAME = "rtx_cpu_paged_decode"
_CFLAGS = ["-O3", "-march=native", "-fopenmp"]
_LDFLAGS = ["-fopenmp"]
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

            folder = build_directory()
            if not (folder / f"{_NAME}.so").exists():
                log.warning("building the C++ CPU decode-attention kernel once for this torch and CPU (about a "
                            "minute on two cores) into %s", folder)
            folder.mkdir(parents=True, exist_ok=True)
            module = load(name=_NAME, sources=[str(_SOURCE)], extra_cflags=_CFLAGS, extra_ldflags=_LDFLAGS,
                          build_directory=str(folder), verbose=False)
            _kernel = module.paged_decode_attention
        except Exception as exc:  # no compiler, no ninja, or a build error: the torch path still works
            log.warning("CPU decode-attention kernel unavailable, using the torch path: %s", exc)
            _kernel = None
        return _kernel


def build_directory() -> Path:
    """Where the kernel is built: under ``TORCH_EXTENSIONS_DIR`` if set, else ``$XDG_CACHE_HOME/rtx-serve`` (or
    ``~/.cache/rtx-serve``), in a folder named by what the binary depends on, so that every environment with the
    same torch finds the same build and another torch, source or CPU never loads a stale one."""
    import torch

    key = hashlib.sha256()
    for part in (torch.__version__, sys.implementation.cache_tag, platform.machine(), _cpu_model(),
                 " ".join(_CFLAGS + _LDFLAGS)):
        key.update(part.encode() + b"\0")
    key.update(_SOURCE.read_bytes())
    base = os.environ.get("TORCH_EXTENSIONS_DIR")
    root = Path(base) if base else Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "rtx-serve"
    return root / "cpu-kernels" / f"{_NAME}-{key.hexdigest()[:16]}"


def _cpu_model() -> str:
    # -march=native code runs only on CPUs like the one that built it.
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()
