"""Every command of the README's quick start, run as written: each ```bash block is a bash script, with only the
port moved to a free one, a wait for each server sent to the background, and a Hub cache built here for the Hub
model (offline; the weights are the default model's own). ``make test`` is the one command not run: it is what runs
this test."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
from pathlib import Path

import pytest
from safetensors.torch import save_file

from rtxcore.models.resolve import resolve_model
from tests.helpers import REPO

pytestmark = pytest.mark.model

HUB_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
COMMIT = "0123456789abcdef0123456789abcdef01234567"
CHAT_INPUT = "Say hello.\n/reset\nName a colour.\n/exit\n"
# Waits for the server just sent to the background (the line before) to answer /ready, then goes on.
WAIT_READY = """for _ in $(seq 600); do curl -sf -o /dev/null http://127.0.0.1:{port}/ready && break; sleep 0.5; done
curl -sf -o /dev/null http://127.0.0.1:{port}/ready"""


def quick_start_blocks() -> list[str]:
    readme = (REPO / "README.md").read_text()
    section = readme[readme.index("## Quick start"):readme.index("## Layout")]
    return re.findall(r"```bash\n(.*?)```", section, re.DOTALL)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def as_script(block: str, port: int) -> str:
    """The block as bash runs it here: stops at the first failing command, its servers killed at the end."""
    lines = ["set -euo pipefail", "trap 'kill $(jobs -p) 2>/dev/null || true; wait' EXIT"]
    for line in block.replace("8000", str(port)).splitlines():
        lines.append(line)
        if line.rstrip().split("  #")[0].rstrip().endswith("&"):
            lines.append(WAIT_READY.format(port=port))
    return "\n".join(lines) + "\n"


def run_block(block: str, env: dict[str, str] | None = None, port: int | None = None) -> str:
    done = subprocess.run(["bash", "-c", as_script(block, port or _free_port())], cwd=REPO, input=CHAT_INPUT,
                          capture_output=True, text=True, timeout=900, env={**os.environ, **(env or {})})
    assert done.returncode == 0, f"{block}\n--- stdout\n{done.stdout[-3000:]}\n--- stderr\n{done.stderr[-3000:]}"
    return done.stdout


def json_objects(text: str) -> list[dict]:
    """The JSON objects printed in ``text`` (curl ends none with a newline, and servers print lines of their own)."""
    decoder, found, i = json.JSONDecoder(), [], text.find("{")
    while i >= 0:
        try:
            value, end = decoder.raw_decode(text, i)
        except json.JSONDecodeError:
            i = text.find("{", i + 1)
            continue
        found.append(value)
        i = text.find("{", end)
    return found


def block_with(fragment: str) -> str:
    [block] = [b for b in quick_start_blocks() if fragment in b]
    return block


def test_every_block_is_run_here():
    fragments = ("make run", "rtx generate", "--api-key sk-local --port", "rtx pull", "rtx plugins list")
    assert len(quick_start_blocks()) == len(fragments)
    for fragment in fragments:
        block_with(fragment)


def test_make_run_serves_the_default_model():
    block = block_with("make run")
    assert [line.split("#")[0].split() for line in block.splitlines()] == [["make", "run"], ["make", "test"]]
    with socket.socket() as s:
        assert s.connect_ex(("127.0.0.1", 8000)) != 0, "port 8000 is taken: `make run` cannot be checked"
    [models] = json_objects(run_block("make run &\ncurl -s http://127.0.0.1:8000/v1/models\n", port=8000))
    assert models["data"][0]["id"] == "smollm2-135m"


def test_generate_and_chat():
    out = run_block(block_with("rtx generate"))
    assert "Paris" in out
    assert out.count(">>>") >= 3  # the chat's prompt before each of the three lines typed


def test_serve_with_an_api_key_and_a_json_schema():
    out = run_block(block_with("--api-key sk-local --port"))
    answers = json_objects(out)
    assert [a["object"] for a in answers] == ["chat.completion", "chat.completion", "response"]
    place = json.loads(answers[1]["choices"][0]["message"]["content"])
    assert isinstance(place["city"], str) and isinstance(place["country"], str)
    assert answers[2]["output"][0]["content"][0]["text"]  # the Responses API's answer


@pytest.fixture(scope="module")
def hub_cache(tmp_path_factory) -> Path:
    """An HF cache holding the README's Hub id at main: the default model as a Hugging Face directory."""
    cache = tmp_path_factory.mktemp("hub")
    repo = cache / f"models--{HUB_ID.replace('/', '--')}"
    snapshot = repo / "snapshots" / COMMIT
    snapshot.mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT)
    source = resolve_model(None)
    (snapshot / "config.json").write_text(json.dumps(source.config.to_hf()))
    save_file({name: t.contiguous() for name, t in source.weights()}, str(snapshot / "model.safetensors"))
    source.tokenizer().save(snapshot)
    return cache


def test_a_hub_model_pulled_and_served(hub_cache):
    out = run_block(block_with("rtx pull"), env={"HF_HUB_CACHE": str(hub_cache), "HF_HUB_OFFLINE": "1"})
    assert out.splitlines()[0].endswith(f"snapshots/{COMMIT}")
    [models] = json_objects(out)
    assert [m["id"] for m in models["data"]] == [HUB_ID]


def test_plugins_list():
    out = run_block(block_with("rtx plugins list"))
    assert "structured_output" in out and max(len(line) for line in out.splitlines()) <= 100
