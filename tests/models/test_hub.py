"""Models by Hugging Face Hub id, from a local cache this test builds in the Hub's own layout, offline: no
download happens in tests."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors.torch import save_file

from rtxcore.models.hub import is_hub_id
from rtxcore.models.resolve import resolve_model
from tests.helpers import REPO

COMMIT = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture
def hub_cache(tmp_path: Path) -> Path:
    """An HF cache holding ``acme/tiny`` at main: dummy:tiny's config and weights as a Hugging Face directory."""
    cache = tmp_path / "hub"
    repo = cache / "models--acme--tiny"
    snapshot = repo / "snapshots" / COMMIT
    snapshot.mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT)
    source = resolve_model("dummy:tiny")
    (snapshot / "config.json").write_text(json.dumps(source.config.to_hf()))
    save_file({name: t.contiguous() for name, t in source.weights()}, str(snapshot / "model.safetensors"))
    return cache


def run(code_or_args: list[str], cache: Path) -> subprocess.CompletedProcess:
    # A process of its own: huggingface_hub reads HF_HUB_CACHE and HF_HUB_OFFLINE when it is imported.
    env = {**os.environ, "HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, *code_or_args], capture_output=True, text=True, timeout=120, cwd=REPO,
                          env=env)


def test_a_cached_hub_id_loads_and_generates(hub_cache):
    code = ("from rtxcore.engine.config import EngineConfig; from rtxcore.engine.llm import LLM; "
            "from rtxcore.sampling_params import SamplingParams; "
            "llm = LLM(EngineConfig(model='acme/tiny', device='cpu', num_kv_blocks=8)); "
            "print(llm.core.source.name, llm.core.source.origin); "
            "print(len(llm.generate([[5, 6, 7]], SamplingParams(max_tokens=4, ignore_eos=True))[0].token_ids))")
    done = run(["-c", code], hub_cache)
    assert done.returncode == 0, done.stderr[-2000:]
    name, origin, count = done.stdout.split()
    assert name == "acme/tiny" and origin.endswith(f"snapshots/{COMMIT}") and count == "4"


def test_pull_prints_the_snapshot_and_missing_models_say_what_to_do(hub_cache):
    pulled = run(["-m", "rtxcore.cli.main", "pull", "acme/tiny"], hub_cache)
    assert pulled.returncode == 0 and pulled.stdout.strip().endswith(f"snapshots/{COMMIT}"), pulled.stderr
    for args in (["pull", "acme/missing"], ["generate", "--model", "acme/missing", "hi"]):
        done = run(["-m", "rtxcore.cli.main", *args], hub_cache)
        assert done.returncode == 2, done.stderr
        [line] = done.stderr.strip().splitlines()[-1:]
        assert "acme/missing is not in the Hugging Face cache" in line and "rtx pull acme/missing" in line
    revision = run(["-m", "rtxcore.cli.main", "generate", "--model", "dummy:tiny", "--revision", "v1", "1"],
                   hub_cache)
    assert revision.returncode == 2 and "applies to Hugging Face Hub ids" in revision.stderr


def test_what_counts_as_a_hub_id(tmp_path, monkeypatch):
    assert is_hub_id("Qwen/Qwen2.5-0.5B-Instruct") and is_hub_id("acme/tiny")
    assert not is_hub_id("dummy:tiny") and not is_hub_id("model.gguf") and not is_hub_id("/abs/path")
    assert not is_hub_id("a/b/c")
    (tmp_path / "acme" / "tiny").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    assert not is_hub_id("acme/tiny"), "an existing local folder is a path, not a Hub id"
