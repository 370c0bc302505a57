"""transformers imports Hugging Face's `kernels` package; this checkout's kernels/ folder must never stand in for it
(rtxcore/hf_transformers.py)."""

from __future__ import annotations

import importlib
import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

from rtxcore.hf_transformers import unshadow_hub_kernels

ROOT = Path(__file__).resolve().parent.parent


def hub_kernels_installed() -> bool:
    saved = sys.path[:]
    sys.path[:] = [p for p in saved if Path(p or ".").resolve() != ROOT]
    try:
        spec = importlib.util.find_spec("kernels") if "kernels" not in sys.modules else sys.modules["kernels"].__spec__
        return spec is not None and spec.origin is not None and Path(spec.origin).parent != ROOT / "kernels"
    finally:
        sys.path[:] = saved


@pytest.mark.skipif(not hub_kernels_installed(), reason="Hugging Face's kernels package is not installed")
def test_our_kernels_folder_loaded_as_kernels_is_replaced_by_theirs(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT))
    # What transformers' failed import leaves behind: this checkout's folder loaded under the name.
    for name in [n for n in sys.modules if n == "kernels" or n.startswith("kernels.")]:
        monkeypatch.delitem(sys.modules, name)
    ours = importlib.import_module("kernels")
    assert Path(ours.__file__).parent == ROOT / "kernels"
    unshadow_hub_kernels()
    theirs = sys.modules["kernels"]
    assert Path(theirs.__file__).parent != ROOT / "kernels" and hasattr(theirs, "LayerRepository")


@pytest.mark.skipif(not hub_kernels_installed(), reason="Hugging Face's kernels package is not installed")
def test_transformers_imports_in_a_fresh_process_with_the_checkout_first_on_the_path():
    """As pytest or `python -m` from the root leave it, and nothing imported before (this test session has imported
    theirs already, so the check runs in new interpreters): a plain import of transformers' model code fails, the
    helper's succeeds."""
    pytest.importorskip("transformers")
    first = f"import sys; sys.path.insert(0, {str(ROOT)!r}); "
    plain = first + "import transformers; print(transformers.LlamaForCausalLM.__name__)"
    helped = first + ("from rtxcore.hf_transformers import import_transformers; "
                      "print(import_transformers().LlamaForCausalLM.__name__)")
    runs = [subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
            for code in (plain, helped)]
    assert runs[0].returncode != 0 and "kernels" in runs[0].stderr
    assert runs[1].returncode == 0, runs[1].stderr[-2000:]
    assert runs[1].stdout.strip() == "LlamaForCausalLM"
