"""Importing Hugging Face transformers beside a checkout of this repository.

transformers (5.25 on) imports Hugging Face's ``kernels`` package when it is installed, which it now is with it.
This repository's ``kernels/`` folder is installed as ``rtx_kernels``, but wherever the checkout's root is on
``sys.path`` (pytest puts it there, and so does ``python -m`` run from the root) that folder is importable as
``kernels`` too, ahead of site-packages: transformers then imports our Triton kernels and fails on its first name.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from pathlib import Path
from types import ModuleType


def _our_kernels_dir() -> Path | None:
    spec = importlib.util.find_spec("rtx_kernels")
    return Path(spec.origin).parent.resolve() if spec is not None and spec.origin else None


def unshadow_hub_kernels() -> None:
    """Make ``import kernels`` give Hugging Face's package where it is installed, never this repository's folder
    (imported before transformers needs it, with the checkout's root left out of ``sys.path`` meanwhile)."""
    ours = _our_kernels_dir()
    if ours is None:
        return
    loaded = sys.modules.get("kernels")
    if loaded is not None:
        if not loaded.__file__ or Path(loaded.__file__).parent.resolve() != ours:
            return  # theirs, or some other package that transformers would get anyway
        for name in [n for n in sys.modules if n == "kernels" or n.startswith("kernels.")]:
            del sys.modules[name]
    root = ours.parent
    saved = sys.path[:]
    sys.path[:] = [p for p in saved if Path(os.path.abspath(p or os.curdir)).resolve() != root]
    try:
        if importlib.util.find_spec("kernels") is not None:
            importlib.import_module("kernels")
    except Exception:  # a broken install of theirs: transformers reports it when it needs it
        pass
    finally:
        sys.path[:] = saved


def import_transformers() -> ModuleType:
    """``import transformers``, after :func:`unshadow_hub_kernels`; raises ImportError as the import does."""
    unshadow_hub_kernels()
    return importlib.import_module("transformers")
