"""rtxcore.envs: every RTX_* switch is declared with a doc and a default, parsed when read, and documented."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from rtxcore import envs
from rtxcore.errors import ConfigError
from rtxcore.registry import load_plugins
from tests.helpers import REPO

DOC = (REPO / "docs" / "environment.md").read_text()
# Switches whose every value is well formed: free text, paths and name lists.
_FREE_KINDS = ("str", "path", "names")


def _malformable() -> list[envs.Switch[object]]:
    return [s for s in envs.SWITCHES.values() if s.kind not in _FREE_KINDS]


@pytest.mark.parametrize("name", sorted(envs.SWITCHES))
def test_every_switch_has_a_doc_a_kind_and_a_default(name):
    switch = envs.SWITCHES[name]
    assert switch.name == name and name.startswith("RTX_")
    assert getattr(envs, name) is switch, "each switch is a module attribute under its own name"
    assert len(switch.doc.split()) >= 8 and "\n" not in switch.doc
    assert switch.kind
    # Unset and empty both give the default.
    assert switch.get({}) == switch.default
    assert switch.get({name: ""}) == switch.default


def test_module_declares_no_switch_outside_the_table():
    declared = {name for name, value in vars(envs).items() if isinstance(value, envs.Switch)}
    assert declared == set(envs.SWITCHES)


@pytest.mark.parametrize("switch", _malformable(), ids=lambda s: s.name)
def test_malformed_value_names_the_variable_and_what_it_accepts(switch):
    with pytest.raises(ConfigError) as info:
        switch.get({switch.name: "not-a-value"})
    message = str(info.value)
    assert switch.name in message and "not-a-value" in message
    accepted = ("1", "0") if switch.kind == "bool" else switch.kind.split("|")
    assert all(word in message for word in accepted), message


def test_values_parse_to_their_types():
    assert envs.RTX_PDL.get({"RTX_PDL": "0"}) is False
    assert envs.RTX_PDL.get({"RTX_PDL": "TRUE"}) is True
    assert envs.RTX_TORCH_KERNELS.get({"RTX_TORCH_KERNELS": "Triton"}) == "triton"
    assert envs.RTX_PLUGINS.get({"RTX_PLUGINS": " fcfs, lru,,"}) == {"fcfs", "lru"}
    assert envs.RTX_GRAPH_CACHE.get({"RTX_GRAPH_CACHE": "~/graphs"}) == Path.home() / "graphs"


def test_values_are_read_when_asked_for(monkeypatch):
    monkeypatch.setenv("RTX_ORT_PROVIDER", "cpu")
    assert envs.RTX_ORT_PROVIDER.get() == "cpu"
    monkeypatch.setenv("RTX_ORT_PROVIDER", "cuda")
    assert envs.RTX_ORT_PROVIDER.get() == "cuda"


def test_no_reader_parses_a_switch_at_import_time():
    # Every switch malformed: a module that read one while being imported would fail here.
    env = {name: "not-a-value" for name in envs.SWITCHES}
    modules = ["rtxcore.registry", "rtx_kernels.cpu_ops", "rtx_kernels.pdl", "rtx_kernels.quant_matmul",
               "rtx_plugins.backends.torch_backend.backend", "rtx_plugins.backends.torch_backend.triton_attention",
               "rtx_plugins.backends.onnxruntime_backend.session", "rtx_plugins.backends.graph_runtime.cache"]
    code = "import importlib, sys\nfor name in sys.argv[1:]:\n    importlib.import_module(name)\n"
    proc = subprocess.run([sys.executable, "-c", code, *modules], env={**os.environ, **env},
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr


def test_registry_honours_rtx_plugins(monkeypatch):
    monkeypatch.setenv("RTX_PLUGINS", "fcfs,lru")
    assert {record.plugin for record in load_plugins().records()} == {"fcfs", "lru"}
    monkeypatch.setenv("RTX_PLUGINS", "fcfs;lru")  # one name nothing is called: nothing loads
    assert load_plugins().records() == []


def test_graph_cache_honours_rtx_graph_cache(monkeypatch, tmp_path):
    from rtx_plugins.backends.graph_runtime.cache import CACHE_DIR_ENV, default_cache_dir

    assert CACHE_DIR_ENV == "RTX_GRAPH_CACHE"
    monkeypatch.setenv(CACHE_DIR_ENV, str(tmp_path))
    assert default_cache_dir() == tmp_path
    monkeypatch.delenv(CACHE_DIR_ENV)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default_cache_dir() == tmp_path / "xdg" / "rtx-serve" / "graphs"


def test_onnxruntime_backend_honours_rtx_ort_provider(monkeypatch):
    pytest.importorskip("onnxruntime")
    from rtx_plugins.backends.onnxruntime_backend.session import choose_device

    monkeypatch.setenv("RTX_ORT_PROVIDER", "cpu")
    assert choose_device("auto") == "cpu"
    monkeypatch.setenv("RTX_ORT_PROVIDER", "tpu")
    with pytest.raises(ConfigError, match="RTX_ORT_PROVIDER"):
        choose_device("auto")


def _documented() -> list[str]:
    return re.findall(r"^\| `(RTX_[A-Z0-9_]+)` \|", DOC, flags=re.MULTILINE)


def test_doc_lists_every_switch_once_and_no_other():
    documented = _documented()
    assert len(documented) == len(set(documented)), "a switch is listed twice"
    assert set(documented) == set(envs.SWITCHES)
    # Nor does the prose name a variable that does not exist.
    assert set(re.findall(r"RTX_[A-Z0-9_]+", DOC)) <= set(envs.SWITCHES)


def test_doc_gives_each_switch_its_declared_type():
    for switch in envs.SWITCHES.values():
        row = re.search(rf"^\| `{switch.name}` \| (.+?) \|", DOC, flags=re.MULTILINE)
        assert row is not None
        assert row.group(1).strip("`").replace("\\|", "|") == switch.kind, switch.name
