"""C++ CPU kernels, compiled once with torch's extension builder and cached between runs.

Compiling needs a C++ compiler and ninja; when either is missing, or ``RTX_CPU_KERNELS=0``, callers fall back
to their pure-torch path. The build (about a minute on two cores) goes to a folder of its own per torch version,
Python ABI, source, flags and CPU (:func:`build_directory`), not to torch's default cache, which is keyed by Python
version only: two environments on one machine with different torch builds would otherwise rebuild it each time they
alternate. ``scripts/setup.sh`` builds it during set-up, so the first ``rtx generate`` does not. A build prints one
line on stderr, ended with its time when it is done; a cached build prints nothing.
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable

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
            _kernel = _load_or_build(build_directory()).paged_decode_attention
        except Exception as exc:  # no compiler, no ninja, or a build error: the torch path still works
            log.warning("CPU decode-attention kernel unavailable, using the torch path: %s", exc)
            _kernel = None
        return _kernel


def _load_or_build(folder: Path) -> Any:
    built = folder / f"{_NAME}.so"
    if built.exists():
        # Built already (the folder's name covers torch, source, flags and CPU): import the binary itself.
        # cpp_extension's load() would find it too, after importing setuptools and asking ninja (0.3 s of a start
        # that aims at 5 s). A binary that does not import (a build cut short) is built again below.
        try:
            return _import_built(built)
        except ImportError as exc:
            log.warning("the built CPU kernel %s does not load (%s); building it again", built, exc)
    from torch.utils.cpp_extension import load

    # One line, ended when the build is: nothing at all when the build is cached.
    sys.stderr.write("building the CPU attention kernel (once per torch version; ~1 min)...")
    sys.stderr.flush()
    folder.mkdir(parents=True, exist_ok=True)
    started, outcome = time.monotonic(), "failed"
    try:
        module = load(name=_NAME, sources=[str(_SOURCE)], extra_cflags=_CFLAGS, extra_ldflags=_LDFLAGS,
                      build_directory=str(folder), verbose=False)
        outcome = "done"
    finally:
        sys.stderr.write(f" {outcome} in {time.monotonic() - started:.0f}s\n")
        sys.stderr.flush()
    return module


def _import_built(path: Path) -> Any:
    import importlib.util

    import torch  # noqa: F401  (the extension links against torch's libraries, loaded by importing it)

    spec = importlib.util.spec_from_file_location(_NAME, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot import {path}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


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
