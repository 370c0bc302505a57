"""Resumable streams and durable requests through the HTTP app, in process on ``dummy:tiny``: the resume endpoint,
``Idempotency-Key``, tenant isolation, fsync before acknowledgement, and a restart from a journal left mid-request.

A restart is simulated by what a crash leaves: the journal of a finished run cut after some of a request's records
(records are appended in order, so any prefix is a state a ``kill -9`` can leave), read by a fresh runtime.
"""

from __future__ import annotations

import asyncio
import json
import logging
import shutil
import time

import pytest
from starlette.testclient import TestClient

from rtxcore.engine.config import EngineConfig
from rtxcore.errors import EngineFailed
from rtxcore.server.http import build_app
from rtxcore.server.serving.durable.records import decode_records, encode_record
from rtxcore.server.serving.runtime import ServingRuntime
from rtxcore.server.serving.tenants import TenantRegistry
from tests.helpers.durable_app import (
    LONG_STREAM,
    crash_copy,
    crashed_mid_stream,
    events,
    make_runtime,
    records,
    serving,
)

PROMPT = [3, 14, 15, 92, 65, 35]
STREAM = {"prompt": PROMPT, "max_tokens": 24, "temperature": 0, "ignore_eos": True, "stream": True}
FULL = {"prompt": PROMPT, "max_tokens": 24, "temperature": 0, "ignore_eos": True, "logprobs": 0}
# dummy:tiny has no tokenizer: logprobs make every output a chunk (it names its token).
COMPLETION_STREAM = {**FULL, "stream": True}
KEYS = {"alice": "alice-key", "bob": "bob-key"}


TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
CALLERS_TRACE = {"traceparent": f"00-{TRACE_ID}-00f067aa0ba902b7-01", "tracestate": "vendor=opaque"}


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    """One uninterrupted streaming and one non-streaming request; their responses and journal."""
    state_dir = tmp_path_factory.mktemp("finished")
    runtime = make_runtime(state_dir)
    with serving(runtime) as client:
        stream = client.post("/generate", json=STREAM, headers=CALLERS_TRACE)
        full = client.post("/v1/completions", json=FULL, headers={"Idempotency-Key": "full-1"})
    assert stream.status_code == 200 and full.status_code == 200
    return state_dir, stream, full


# -- the resume endpoint ------------------------------------------------------------------------------------------


def test_every_event_has_an_id_and_the_stream_resumes_after_any_of_them(tmp_path):
    with serving(make_runtime(tmp_path)) as client:
        resp = client.post("/v1/completions", json=COMPLETION_STREAM)
        req_id = resp.headers["x-rtx-request-id"]
        sent = events(resp.text)
        assert [i for i, _ in sent] == list(range(1, len(sent) + 1)) and len(sent) == 25 and sent[-1][1] == "[DONE]"
        for last in (0, 1, 10, len(sent) - 1, len(sent)):
            again = client.get(f"/v1/streams/{req_id}", headers={"Last-Event-ID": str(last)})
            assert again.status_code == 200 and again.headers["x-rtx-request-id"] == req_id
            expected = sent[last:] if last < len(sent) else sent[-1:]  # after [DONE]: [DONE] again
            assert events(again.text) == expected
        assert events(client.get(f"/v1/streams/{req_id}?last_event_id=5").text) == sent[5:]


def test_native_streams_end_with_their_finished_event_and_resume_too(tmp_path):
    with serving(make_runtime(tmp_path)) as client:
        resp = client.post("/generate", json=STREAM)
        sent = events(resp.text)
        assert len(sent) == 24 and '"finished":true' in sent[-1][1]
        req_id = resp.headers["x-rtx-request-id"]
        assert events(client.get(f"/v1/streams/{req_id}", headers={"Last-Event-ID": "20"}).text) == sent[20:]
        assert client.get(f"/v1/streams/{req_id}", headers={"Last-Event-ID": "24"}).text == ""
        assert client.get(f"/v1/streams/{req_id}", headers={"Last-Event-ID": "25"}).status_code == 400


def test_a_non_streaming_request_is_fetched_whole(tmp_path):
    with serving(make_runtime(tmp_path)) as client:
        resp = client.post("/v1/completions", json=FULL)
        again = client.get(f"/v1/streams/{resp.headers['x-rtx-request-id']}")
        assert again.status_code == 200 and again.json() == resp.json()


@pytest.mark.parametrize("where, value, status, param", [
    ("header", "abc", 400, "last_event_id"),
    ("header", "-1", 400, "last_event_id"),
    ("header", "9999", 400, "last_event_id"),
    ("query", "1.5", 400, "last_event_id"),
    ("both", "3", 400, "last_event_id"),
])
def test_bad_last_event_ids_are_400(tmp_path, where, value, status, param):
    with serving(make_runtime(tmp_path)) as client:
        req_id = client.post("/generate", json=STREAM).headers["x-rtx-request-id"]
        headers = {"Last-Event-ID": value} if where in ("header", "both") else {}
        query = f"?last_event_id={value if where == 'query' else 4}" if where in ("query", "both") else ""
        resp = client.get(f"/v1/streams/{req_id}{query}", headers=headers)
        assert resp.status_code == status and resp.json()["error"]["param"] == param


def test_unknown_ids_are_404_json(tmp_path):
    with serving(make_runtime(tmp_path)) as client:
        resp = client.get("/v1/streams/rq-000000000000000000000000")
        assert resp.status_code == 404 and resp.json()["error"]["param"] == "request_id"


def test_finished_requests_are_forgotten_after_the_retention_window(tmp_path):
    with serving(make_runtime(tmp_path, journal_retention_s=0.5)) as client:
        resp = client.post("/v1/completions", json=FULL, headers={"Idempotency-Key": "k"})
        req_id = resp.headers["x-rtx-request-id"]
        assert client.get(f"/v1/streams/{req_id}").status_code == 200
        time.sleep(1.6)  # retention, plus the registry's purge interval
        assert client.get(f"/v1/streams/{req_id}").status_code == 404
        again = client.post("/v1/completions", json=FULL, headers={"Idempotency-Key": "k"})
        assert again.status_code == 200 and again.headers["x-rtx-request-id"] != req_id


def test_without_a_state_dir_there_is_nothing_to_resume():
    runtime = ServingRuntime(EngineConfig(model="dummy:tiny"))
    runtime.load()
    try:
        with TestClient(build_app(runtime)) as client:
            resp = client.post("/generate", json=STREAM)
            assert '"finished":true' in events(resp.text)[-1][1] and resp.headers["x-rtx-request-id"]
            missing = client.get(f"/v1/streams/{resp.headers['x-rtx-request-id']}")
            assert missing.status_code == 404 and "--state-dir" in missing.json()["error"]["message"]
            # Idempotency-Key needs the journal: without one it is ignored, and a repeat is a new request.
            first = client.post("/v1/completions", json=FULL, headers={"Idempotency-Key": "k"})
            second = client.post("/v1/completions", json=FULL, headers={"Idempotency-Key": "k"})
            assert first.headers["x-rtx-request-id"] != second.headers["x-rtx-request-id"]
    finally:
        runtime.stop()


# -- Idempotency-Key ---------------------------------------------------------------------------------------------


def test_a_repeated_idempotency_key_attaches_to_the_first_request(tmp_path):
    with serving(make_runtime(tmp_path)) as client:
        first = client.post("/v1/completions", json=FULL, headers={"Idempotency-Key": "order-1"})
        again = client.post("/v1/completions", json={**FULL}, headers={"Idempotency-Key": "order-1"})
        assert again.status_code == 200 and again.json() == first.json()
        assert again.headers["x-rtx-request-id"] == first.headers["x-rtx-request-id"]
        streamed = client.post("/generate", json=STREAM, headers={"Idempotency-Key": "order-2"})
        replayed = client.post("/generate", json=STREAM, headers={"Idempotency-Key": "order-2",
                                                                  "Last-Event-ID": "20"})
        assert events(replayed.text) == events(streamed.text)[20:]
    accepts = [r for r in records(tmp_path) if r["t"] == "accept"]
    assert len(accepts) == 2, "a repeated key must not start the request again"


@pytest.mark.parametrize("key, body, status, code", [
    ("order-1", {**FULL, "max_tokens": 5}, 422, "idempotency_key_reused"),
    ("bad key", FULL, 400, "invalid_value"),
    ("x" * 256, FULL, 400, "invalid_value"),
])
def test_bad_or_reused_idempotency_keys(tmp_path, key, body, status, code):
    with serving(make_runtime(tmp_path)) as client:
        client.post("/v1/completions", json=FULL, headers={"Idempotency-Key": "order-1"})
        resp = client.post("/v1/completions", json=body, headers={"Idempotency-Key": key})
        assert resp.status_code == status
        assert resp.json()["error"]["code"] == code and resp.json()["error"]["param"] == "Idempotency-Key"


def test_a_key_whose_first_use_was_refused_is_free_again(tmp_path):
    with serving(make_runtime(tmp_path)) as client:
        refused = client.post("/v1/completions", json={**FULL, "max_tokens": 0}, headers={"Idempotency-Key": "k"})
        assert refused.status_code == 400
        assert client.post("/v1/completions", json=FULL, headers={"Idempotency-Key": "k"}).status_code == 200


# -- tenants -----------------------------------------------------------------------------------------------------


def test_a_tenant_resumes_only_its_own_requests(tmp_path):
    tenants = TenantRegistry.from_config({}, environ={"RTX_API_KEYS": ",".join(f"{t}={k}" for t, k in KEYS.items())})
    alice, bob = ({"Authorization": f"Bearer {KEYS[t]}"} for t in ("alice", "bob"))
    with serving(make_runtime(tmp_path, tenants)) as client:
        resp = client.post("/generate", json=STREAM, headers={**alice, "Idempotency-Key": "shared"})
        req_id = resp.headers["x-rtx-request-id"]
        assert client.get(f"/v1/streams/{req_id}", headers=alice).status_code == 200
        other = client.get(f"/v1/streams/{req_id}", headers=bob)
        unknown = client.get("/v1/streams/rq-000000000000000000000000", headers=bob)
        assert other.status_code == 404 and other.json()["error"] == {
            **unknown.json()["error"], "message": unknown.json()["error"]["message"].replace(
                "rq-000000000000000000000000", req_id)}
        assert client.get(f"/v1/streams/{req_id}").status_code == 401
        # Keys are scoped to their tenant: bob's "shared" is a request of his own.
        bobs = client.post("/generate", json=STREAM, headers={**bob, "Idempotency-Key": "shared"})
        assert bobs.status_code == 200 and bobs.headers["x-rtx-request-id"] != req_id


def alice_limited_to_one():
    return TenantRegistry.from_config({"alice": {"key_env": "ALICE_KEY", "max_concurrency": 1}},
                                      environ={"ALICE_KEY": KEYS["alice"]})


ALICE = {"Authorization": f"Bearer {KEYS['alice']}"}


def test_a_resumed_request_counts_towards_its_tenants_concurrency(tmp_path):
    req_id, crashed = crashed_mid_stream(tmp_path, alice_limited_to_one, ALICE)
    runtime = make_runtime(crashed, alice_limited_to_one())
    with serving(runtime) as client:
        (entry,) = [e for e in runtime.durable.entries() if not e.finished]  # resumed, 1,500 tokens to go
        refused = client.post("/generate", json={**LONG_STREAM, "max_tokens": 2}, headers=ALICE)
        assert refused.status_code == 429 and "limit of 1 concurrent" in refused.text, refused.text
        assert not entry.finished


# -- durability --------------------------------------------------------------------------------------------------


def test_the_accept_record_is_fsynced_before_the_response_starts(tmp_path):
    runtime = make_runtime(tmp_path)
    journal = runtime.durable.journal
    journal.options.sync_interval_s = 60  # no periodic sync: only the accept's commit can make it durable
    app = build_app(runtime)
    at_response_start: list[tuple[int, bytes]] = []

    async def recording(scope, receive, send):
        async def send_recorded(message):
            if message["type"] == "http.response.start":
                at_response_start.append((journal.synced_offset, journal.path.read_bytes()))
            await send(message)

        await app(scope, receive, send_recorded)

    with serving(runtime, recording) as client:
        resp = client.post("/generate", json=STREAM)
    synced, data = at_response_start[0]
    durable = decode_records(data[:synced]).records
    assert {"t": "accept", "id": resp.headers["x-rtx-request-id"]}.items() <= durable[0].items()


def test_a_stream_resumes_after_a_crash_with_no_duplicate_or_gap(finished_run, tmp_path, caplog):
    state_dir, stream, _ = finished_run
    sent = events(stream.text)
    req_id = stream.headers["x-rtx-request-id"]
    # The crash came after 9 events were journaled; the client had seen 6 of them.
    crashed = crash_copy(state_dir, tmp_path / "crashed",
                         lambda r, i: r["id"] == req_id and r["t"] != "finish" and r.get("seq", 0) <= 9)
    with open(crashed / "journal" / "journal.log", "ab") as f:
        f.write(encode_record({"t": "out", "id": req_id, "seq": 10, "ev": "cut short"})[:30])  # torn write
    with caplog.at_level(logging.INFO, logger="rtx.journal"), caplog.at_level(logging.INFO, logger="rtx.requests"), \
            serving(make_runtime(crashed)) as client:
        resumed = client.get(f"/v1/streams/{req_id}", headers={"Last-Event-ID": "6"})
        metrics = client.get("/metrics").text
    assert "torn last record" in caplog.text and "resumed 1 unfinished requests" in caplog.text
    # Resumed in the trace it came with: the journal kept the server's span, sent back, and the caller's tracestate.
    (accept,) = [r for r in records(crashed) if r["id"] == req_id and r["t"] == "accept"]
    assert accept["trace"] == {"traceparent": stream.headers["traceparent"], "tracestate": "vendor=opaque"}
    finished = [json.loads(r.getMessage()) for r in caplog.records if r.name == "rtx.requests"]
    assert [line.get("trace_id") for line in finished] == [TRACE_ID]
    assert resumed.status_code == 200 and events(resumed.text) == sent[6:]
    assert 'rtx_journal_resumed_requests_total{model="dummy:tiny"} 1.0' in metrics
    # Finished once: one finish record, after the resumed events.
    assert [r["t"] for r in records(crashed) if r["id"] == req_id].count("finish") == 1


def test_a_full_response_is_completed_after_a_crash_and_fetched_by_its_idempotency_key(finished_run, tmp_path):
    state_dir, _, full = finished_run
    req_id = full.headers["x-rtx-request-id"]
    outputs = [i for i, r in enumerate(records(state_dir)) if r["id"] == req_id and r["t"] == "out"]
    crashed = crash_copy(state_dir, tmp_path / "crashed",
                         lambda r, i: r["id"] == req_id and r["t"] != "finish" and i < outputs[10])
    with serving(make_runtime(crashed)) as client:
        again = client.post("/v1/completions", json=FULL, headers={"Idempotency-Key": "full-1"})
    assert again.status_code == 200 and again.headers["x-rtx-request-id"] == req_id
    # The same response, but for the last digits of logprobs computed over re-prefilled (not decoded) KV.
    got, expected = again.json(), full.json()
    got_lps, expected_lps = (b["choices"][0]["logprobs"].pop("token_logprobs") for b in (got, expected))
    got_tops, expected_tops = (b["choices"][0]["logprobs"].pop("top_logprobs") for b in (got, expected))
    assert got == expected and got_lps == pytest.approx(expected_lps, abs=1e-4)
    assert [list(t) for t in got_tops] == [list(t) for t in expected_tops]  # the sampled token's among them
    assert all(t == pytest.approx(e, abs=1e-4) for t, e in zip(got_tops, expected_tops))


def test_finished_requests_stay_resumable_after_a_restart(finished_run, tmp_path):
    state_dir, stream, _ = finished_run
    copy = tmp_path / "copy"
    shutil.copytree(state_dir, copy)
    with serving(make_runtime(copy)) as client:
        again = client.get(f"/v1/streams/{stream.headers['x-rtx-request-id']}", headers={"Last-Event-ID": "3"})
    assert events(again.text) == events(stream.text)[3:]


def test_a_damaged_journal_never_stops_the_server(finished_run, tmp_path, caplog):
    state_dir, stream, _ = finished_run
    req_id = stream.headers["x-rtx-request-id"]
    damaged = crash_copy(state_dir, tmp_path / "damaged", lambda r, i: r["id"] == req_id)
    path = damaged / "journal" / "journal.log"
    data = path.read_bytes()
    # Garbage lines, a record of an unknown request, and a damaged accept of another one.
    bad_accept = encode_record({"t": "accept", "id": "rq-bad", "spec": {"kind": "nonsense"}})
    path.write_bytes(b"not a record\n\x00\xff\n" + data + encode_record({"t": "out", "id": "rq-ghost", "seq": 1})
                     + bad_accept)
    with caplog.at_level(logging.WARNING, logger="rtx.journal"), serving(make_runtime(damaged)) as client:
        assert client.get("/ready").status_code == 200
        again = client.get(f"/v1/streams/{req_id}", headers={"Last-Event-ID": "2"})
        metrics = client.get("/metrics").text
    assert events(again.text) == events(stream.text)[2:]
    assert 'rtx_journal_corrupt_records_total{model="dummy:tiny"} 2.0' in metrics
    assert "request rq-ghost has no accept record" in caplog.text and "rq-bad" in caplog.text


def test_an_unfinished_request_with_unreadable_outputs_ends_with_an_error_event(finished_run, tmp_path):
    state_dir, stream, _ = finished_run
    req_id = stream.headers["x-rtx-request-id"]
    crashed = crash_copy(state_dir, tmp_path / "crashed",
                         lambda r, i: r["id"] == req_id and r["t"] != "finish" and r.get("seq", 0) <= 4)
    with open(crashed / "journal" / "journal.log", "ab") as f:
        f.write(encode_record({"t": "out", "id": req_id, "o": {"c": 7, "tok": [1], "text": ""}}))  # no choice 7
    with serving(make_runtime(crashed)) as client:
        rest = events(client.get(f"/v1/streams/{req_id}", headers={"Last-Event-ID": "4"}).text)
    assert [i for i, _ in rest] == [5] and "could not be resumed" in rest[0][1]


def assisted_counts(runtime: ServingRuntime) -> tuple[int, int]:
    """(proposed, accepted) tokens of the proposer of caller-supplied tokens, read on the engine thread."""

    def read(core) -> tuple[int, int]:
        stats = core.speculator.stats["assisted"]
        return stats.num_proposed_tokens, stats.num_accepted_tokens

    return asyncio.run(runtime.async_engine.run_on_engine(read))


@pytest.mark.parametrize("old_record", [False, True])
def test_a_resumed_request_keeps_its_draft_token_ids(tmp_path, old_record):
    with serving(make_runtime(tmp_path / "first")) as client:
        tokens = [t for _, data in events(client.post("/generate", json=STREAM).text)
                  for t in json.loads(data)["token_ids"]]
        drafted = client.post("/generate", json={**STREAM, "draft_token_ids": tokens})
    req_id = drafted.headers["x-rtx-request-id"]
    (accept,) = [r for r in records(tmp_path / "first") if r["id"] == req_id and r["t"] == "accept"]
    assert accept["draft_token_ids"] == tokens and accept["speculative"] is True

    sent = events(drafted.text)
    assert len(sent) < len(tokens)  # tokens came several per event: proposed from the draft and accepted

    def keep(record, index):
        if old_record and record["t"] == "accept":  # as a journal written before these fields existed
            record.pop("draft_token_ids")
            record.pop("speculative")
        return record["id"] == req_id and record["t"] != "finish" and record.get("seq", 0) <= 2

    runtime = make_runtime(crash_copy(tmp_path / "first", tmp_path / "crashed", keep))
    with serving(runtime) as client:
        rest = events(client.get(f"/v1/streams/{req_id}", headers={"Last-Event-ID": "2"}).text)
        proposed, accepted = assisted_counts(runtime)
    # The same tokens, in as many events as the resumed engine's steps gave them.
    assert [t for _, data in sent[:2] + rest for t in json.loads(data)["token_ids"]] == tokens
    # Resumed with its draft, the rest of the output is proposed from it; resumed from an old record, nothing is.
    if old_record:
        assert (proposed, accepted) == (0, 0)
    else:
        assert accepted > 0


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")  # the engine thread's error
def test_a_failed_engine_leaves_journaled_requests_for_the_restart(tmp_path):
    # The engine loop dies under a request (the backend says nothing will step again, as when a parallel rank is
    # gone): not the request's fault, so it ends for its client as in a crash (503, retry) and stays unfinished in
    # the journal.
    state = tmp_path / "state"
    runtime = make_runtime(state)
    backend = runtime.async_engine.core.backend
    execute, calls = backend.execute, []

    def execute_then_fail(batch):  # a few tokens first: the request is accepted and journaled
        calls.append(1)
        if len(calls) <= 5:
            return execute(batch)
        raise EngineFailed("parallel worker rank 1 (pid 1) exited with code -9")

    backend.execute = execute_then_fail
    with serving(runtime) as client:
        resp = client.post("/v1/completions", json=FULL, headers={"Idempotency-Key": "k1"})
        assert resp.status_code == 503 and resp.headers["retry-after"]
        assert "in the journal" in resp.json()["error"]["message"]
    records = decode_records((state / "journal" / "journal.log").read_bytes()).records
    assert sum(r["t"] == "accept" for r in records) == 1 and not any(r["t"] == "finish" for r in records)
    # The restart resumes it, and the same key gets its whole response.
    with serving(make_runtime(state)) as client:
        again = client.post("/v1/completions", json=FULL, headers={"Idempotency-Key": "k1"})
        assert again.status_code == 200 and again.json()["usage"]["completion_tokens"] == 24
