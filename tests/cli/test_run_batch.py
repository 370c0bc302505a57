"""``rtx run-batch``: an OpenAI batch file answered line by line through the serving API, without a server; a file
that is not a batch is refused in one line before the model loads."""

from __future__ import annotations

import json

import pytest

from rtxcore.sampling_params import SamplingParams
from tests.helpers.cli import assert_one_line_error, rtx, run_in_process

CHAT = [{"role": "user", "content": "What is the capital of France?"}]
PROMPT = "The capital of France is"


def _line(custom_id: str, url: str, body: dict) -> str:
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": url, "body": body})


@pytest.mark.model
def test_each_request_is_answered_under_its_custom_id(tmp_path, default_engine):
    batch = tmp_path / "in.jsonl"
    batch.write_text("\n".join([
        _line("chat", "/v1/chat/completions", {"messages": CHAT, "max_tokens": 8, "temperature": 0}),
        _line("cmpl", "/v1/completions", {"prompt": PROMPT, "max_tokens": 6, "temperature": 0, "model": "my-model"}),
        "",  # blank lines are skipped
        _line("emb", "/v1/embeddings", {"input": ["hello", "world"]}),
        _line("bad", "/v1/completions", {"prompt": PROMPT, "max_tokens": -3}),
        _line("other-model", "/v1/completions", {"prompt": PROMPT, "model": "gpt-4o"}),
        _line("two", "/v1/chat/completions", {"messages": CHAT, "max_tokens": 3, "n": 2}),
    ]) + "\n")
    out = tmp_path / "out.jsonl"
    proc = rtx("run-batch", "-i", str(batch), "-o", str(out), "--served-model-name", "my-model",
               "--max-concurrency", "2")
    assert proc.returncode == 0, proc.stderr
    assert "6 requests" in proc.stderr.splitlines()[-1] and "2 refused or failed" in proc.stderr

    answers = {a["custom_id"]: a for a in map(json.loads, out.read_text().splitlines())}
    assert set(answers) == {"chat", "cmpl", "emb", "bad", "other-model", "two"}
    assert len({a["id"] for a in answers.values()}) == 6 and all(a["error"] is None for a in answers.values())
    status = {k: a["response"]["status_code"] for k, a in answers.items()}
    assert status == {"chat": 200, "cmpl": 200, "emb": 200, "bad": 400, "other-model": 404, "two": 200}
    body = {k: a["response"]["body"] for k, a in answers.items()}
    # The answers are the engine's: the same greedy text as offline generation.
    [offline] = default_engine.generate([PROMPT], SamplingParams(max_tokens=6, temperature=0))
    assert body["cmpl"]["choices"][0]["text"] == offline.text and body["cmpl"]["model"] == "my-model"
    assert body["chat"]["object"] == "chat.completion" and body["chat"]["usage"]["completion_tokens"] == 8
    assert len(body["emb"]["data"]) == 2 and len(body["two"]["choices"]) == 2
    assert body["bad"]["error"]["param"] == "max_tokens"
    assert all(a["response"]["request_id"] for a in answers.values())


@pytest.mark.parametrize(("lines", "fragment"), [
    (["{not json"], "line 1: not JSON"),
    (["[1, 2]"], "line 1: expected an object"),
    ([_line("", "/v1/completions", {"prompt": "x"})], "line 1: custom_id must be a non-empty string"),
    ([_line("a", "/v1/completions", {"prompt": "x"}), "", _line("a", "/v1/completions", {"prompt": "y"})],
     "line 3: custom_id 'a' is used twice"),
    ([_line("a", "/v1/responses", {"input": "x"})], "url must be one of"),
    ([json.dumps({"custom_id": "a", "method": "GET", "url": "/v1/completions", "body": {}})], "method must be"),
    ([json.dumps({"custom_id": "a", "method": "POST", "url": "/v1/completions", "body": "x"})], "body must be"),
    ([_line("a", "/v1/completions", {"prompt": "x", "stream": True})], "stream cannot be true"),
    (["", "  "], "holds no requests"),
])
def test_a_file_that_is_not_a_batch_is_refused_before_loading(tmp_path, lines, fragment):
    batch = tmp_path / "in.jsonl"
    batch.write_text("\n".join(lines) + "\n")
    proc = run_in_process("run-batch", "--model", "dummy:tiny", "-i", str(batch), "-o", str(tmp_path / "out.jsonl"))
    assert_one_line_error(proc, fragment)
    assert not (tmp_path / "out.jsonl").exists()


def test_unreadable_files_are_refused(tmp_path):
    out = str(tmp_path / "out.jsonl")
    assert_one_line_error(run_in_process("run-batch", "-i", str(tmp_path / "none.jsonl"), "-o", out),
                          "cannot read batch file")
    batch = tmp_path / "in.jsonl"
    batch.write_text(_line("a", "/v1/completions", {"prompt": "x"}))
    assert_one_line_error(run_in_process("run-batch", "-i", str(batch), "-o", "/no/such/dir/out.jsonl"),
                          "does not exist")
    assert_one_line_error(run_in_process("run-batch", "-i", str(batch), "-o", out, "--max-concurrency", "0"),
                          "--max-concurrency")
