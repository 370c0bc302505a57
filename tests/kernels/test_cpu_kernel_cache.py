"""Where the C++ CPU kernel is built: one folder per torch version, source, flags and CPU, shared by every
environment that has the same ones (torch's own cache is keyed by Python version only)."""

from __future__ import annotations

import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch.utils import cpp_extension

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


BUILD_LINE = re.escape("building the CPU attention kernel (once per torch version; ~1 min)...")


@pytest.fixture
def compiler(monkeypatch, tmp_path) -> SimpleNamespace:
    """The kernel not yet looked for in this process, built into ``tmp_path`` by a stand-in for the compiler (the
    real build takes a minute: what is checked here is what the user is told). ``builds`` lists the calls to torch's
    loader; an exception set as ``error`` makes the build fail."""
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    monkeypatch.delenv("RTX_CPU_KERNELS", raising=False)
    monkeypatch.setattr(cpu_ops, "_tried", False)
    monkeypatch.setattr(cpu_ops, "_kernel", None)
    state = SimpleNamespace(builds=[], error=None)

    def load(name, build_directory, **options):
        state.builds.append(name)
        if state.error is not None:
            raise state.error
        (Path(build_directory) / f"{name}.so").write_bytes(b"")
        return SimpleNamespace(paged_decode_attention=len)

    monkeypatch.setattr(cpp_extension, "load", load)
    return state


def test_a_build_prints_one_line_ended_with_its_time(compiler, capsys):
    assert cpu_ops.paged_decode_kernel() is len
    err = capsys.readouterr().err
    assert re.fullmatch(BUILD_LINE + r" done in \d+s\n", err), err


def test_a_cached_build_is_imported_without_torch_s_loader(compiler, capsys, monkeypatch):
    folder = cpu_ops.build_directory()
    folder.mkdir(parents=True)
    (folder / f"{cpu_ops._NAME}.so").write_bytes(b"")
    imported: list[Path] = []
    monkeypatch.setattr(cpu_ops, "_import_built",
                        lambda path: imported.append(path) or SimpleNamespace(paged_decode_attention=len))
    assert cpu_ops.paged_decode_kernel() is len
    assert imported == [folder / f"{cpu_ops._NAME}.so"] and compiler.builds == []
    assert capsys.readouterr().err == ""


def test_a_binary_that_does_not_import_is_built_again(compiler, capsys):
    folder = cpu_ops.build_directory()
    folder.mkdir(parents=True)
    (folder / f"{cpu_ops._NAME}.so").write_bytes(b"")  # a build cut short: not a shared object
    assert cpu_ops.paged_decode_kernel() is len
    assert compiler.builds == [cpu_ops._NAME]
    assert re.fullmatch(BUILD_LINE + r" done in \d+s\n", capsys.readouterr().err)


def test_a_failed_build_ends_its_line_and_falls_back(compiler, capsys, caplog):
    compiler.error = RuntimeError("no compiler")
    assert cpu_ops.paged_decode_kernel() is None
    err = capsys.readouterr().err
    assert re.fullmatch(BUILD_LINE + r" failed in \d+s\n", err), err
    assert "using the torch path: no compiler" in caplog.text
