"""A request with several choices per prompt and an echoed prompt survives a crash like any other: its journal
record keeps ``n`` and the echo, and the resumed stream goes on with no gap and no duplicate (in process, on
``dummy:tiny``)."""

from __future__ import annotations

import json

from tests.helpers.durable_app import crash_copy, events, make_runtime, records, serving

# Greedy, so that the resumed choices are the uninterrupted ones token for token (a seeded sampled request resumes
# with a seed derived from its progress: reproducible, but not the same draws).
BODY = {"prompt": [[3, 14, 15, 92], [65, 35, 89]], "n": 2, "echo": True, "logprobs": 1, "max_tokens": 12,
        "temperature": 0, "ignore_eos": True, "stream": True}


def test_n_choices_with_echo_resume_after_a_crash(tmp_path):
    with serving(make_runtime(tmp_path / "first")) as client:
        stream = client.post("/v1/completions", json=BODY)
    assert stream.status_code == 200
    sent = events(stream.text)
    req_id = stream.headers["x-rtx-request-id"]
    (accept,) = [r for r in records(tmp_path / "first") if r["id"] == req_id and r["t"] == "accept"]
    assert accept["n"] == 2 and len(accept["spec"]["echo"]) == 2
    opening = json.loads(sent[0][1])
    assert [c["index"] for c in opening["choices"]] == [0, 1, 2, 3]
    assert opening["choices"][0]["logprobs"]["token_logprobs"][0] is None

    crashed = crash_copy(tmp_path / "first", tmp_path / "crashed",
                         lambda r, i: r["id"] == req_id and r["t"] != "finish" and r.get("seq", 0) <= 10)
    with serving(make_runtime(crashed)) as client:
        resumed = client.get(f"/v1/streams/{req_id}", headers={"Last-Event-ID": "5"})
    assert resumed.status_code == 200
    rest = events(resumed.text)
    assert [i for i, _ in rest] == list(range(6, sent[-1][0] + 1))
    # Each choice's tokens as the uninterrupted run gave them (choices interleave in whatever order the steps
    # produce them, which need not be the same twice).
    got, want = _tokens_by_choice(sent[:5] + rest), _tokens_by_choice(sent)
    assert got == want
    finished = [c["index"] for _, d in sent[:5] + rest if d != "[DONE]" for c in json.loads(d)["choices"]
                if c["finish_reason"]]
    assert sorted(finished) == [0, 1, 2, 3]


def _tokens_by_choice(sent: list[tuple[int, str]]) -> dict[int, list[str]]:
    tokens: dict[int, list[str]] = {}
    for _, data in sent:
        if data != "[DONE]":
            for choice in json.loads(data)["choices"]:
                tokens.setdefault(choice["index"], []).extend(choice["logprobs"]["tokens"])
    return tokens
