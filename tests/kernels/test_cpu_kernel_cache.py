"""Where the C++ CPU kernel is built: one folder per torch version, source, flags and CPU, shared by every
environment that has the same ones (torch's own cache is keyed by Python version only)."""

from __future__ import annotations

import torch

from rtx_kernels import cpu_ops


def test_the_build_folder_follows_torch_and_the_source(monkeypatch, tmp_path):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    here = cpu_ops.build_directory()
    assert here.parent == tmp_path / "cpu-kernels" and here == cpu_ops.build_directory()
    monkeypatch.setattr(torch, "__version__", "0.0.0+other")
    assert cpu_ops.build_directory() != here
    monkeypatch.undo()
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    source = tmp_path / "changed.cpp"
    source.write_bytes(cpu_ops._SOURCE.read_bytes() + b"\n// changed\n")
    monkeypatch.setattr(cpu_ops, "_SOURCE", source)
    assert cpu_ops.build_directory() != here


def test_without_torch_extensions_dir_it_is_under_the_user_cache(monkeypatch, tmp_path):
    monkeypatch.delenv("TORCH_EXTENSIONS_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert cpu_ops.build_directory().parent == tmp_path / "rtx-serve" / "cpu-kernels"
