"""Importing Hugging Face transformers beside a checkout of this repository.

transformers (5.25 on) imports Hugging Face's ``kernels`` package when it is installed, which it now is with it.
This repository's ``kernels/`` folder is installed as ``rtx_kernels``, but wherever a checkout's root is on
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


def _is_checkout(entry: str) -> bool:
    """Whether a ``sys.path`` entry is a checkout of this repository (its kernels/ folder beside rtxcore/)."""
    root = Path(os.path.abspath(entry or os.curdir))
    return (root / "kernels" / "launch.py").is_file() and (root / "rtxcore").is_dir()


def unshadow_hub_kernels() -> None:
    """Make ``import kernels`` give Hugging Face's package where it is installed, never a checkout's folder: it is
    imported before transformers needs it, with every checkout left out of ``sys.path`` meanwhile (and a checkout's
    folder that a failed import left in ``sys.modules`` dropped first)."""
    loaded = sys.modules.get("kernels")
    if loaded is not None:
        folder = Path(loaded.__file__).parent if loaded.__file__ else None
        if folder is None or not _is_checkout(str(folder.parent)):
            return  # theirs, or some other package that transformers would get anyway
        for name in [n for n in sys.modules if n == "kernels" or n.startswith("kernels.")]:
            del sys.modules[name]
    saved = sys.path[:]
    kept = [p for p in saved if not _is_checkout(p)]
    if len(kept) == len(saved) and loaded is None:
        return  # no checkout on the path: `import kernels` finds the right package by itself
    sys.path[:] = kept
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
