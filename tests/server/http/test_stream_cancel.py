"""Cancelling a journaled request (DELETE /v1/streams/{id}): with a journal a request outlives its client, so
leaving does not stop it; the cancel does, durably, and gives the tenant's slot back."""

from __future__ import annotations

import json
import time

from rtxcore.server.serving.durable.records import encode_record
from tests.helpers.durable_app import LONG_STREAM, crashed_mid_stream, events, make_runtime, records, serving
from tests.server.http.test_durable_http import ALICE, alice_limited_to_one


def test_delete_stops_a_request_and_gives_back_its_tenants_slot(tmp_path):
    """With a journal, a client that leaves does not stop its request: it ran to its end, holding the tenant's
    concurrency meanwhile. DELETE /v1/streams/{id} stops it, here while it resumes after a restart."""
    alice = ALICE
    req_id, crashed = crashed_mid_stream(tmp_path, alice_limited_to_one, alice)
    runtime = make_runtime(crashed, alice_limited_to_one())
    with serving(runtime) as client:
        (entry,) = [e for e in runtime.durable.entries() if not e.finished]
        assert client.delete(f"/v1/streams/{req_id}").status_code == 401
        cancelled = client.delete(f"/v1/streams/{req_id}", headers=alice)
        assert cancelled.status_code == 200 and cancelled.json() == {
            "id": req_id, "object": "stream.cancellation", "cancelled": True}
        rest = events(client.get(f"/v1/streams/{req_id}", headers=alice).text)
        last = json.loads(rest[-1][1])
        assert last["finished"] and last["finish_reason"] == "abort" and len(rest) < 1500, last
        assert entry.finished
        # Its slot is free: the next request of the tenant is not refused (it was, 429, until the 1,500 tokens).
        assert client.post("/generate", json={**LONG_STREAM, "max_tokens": 2}, headers=alice).status_code == 200
        again = client.delete(f"/v1/streams/{req_id}", headers=alice)
        assert again.status_code == 200 and again.json()["cancelled"] is False
        missing = client.delete("/v1/streams/rq-000000000000000000000000", headers=alice)
        assert missing.status_code == 404 and missing.json()["error"]["param"] == "request_id"
    # The journal has the cancel (fsynced before the answer) and the end: a restart does not run it again.
    kinds = [r["t"] for r in records(crashed) if r["id"] == req_id]
    assert "cancel" in kinds and kinds[-1] == "finish", kinds


def test_a_cancel_in_the_journal_is_not_run_again_after_a_crash(tmp_path):
    """A crash after the cancel was acknowledged, before the request's end reached the journal: the restart ends
    it with a `cancelled` error rather than running it to max_tokens."""
    req_id, crashed = crashed_mid_stream(tmp_path)
    log = crashed / "journal" / "journal.log"
    log.write_bytes(log.read_bytes() + encode_record({"t": "cancel", "id": req_id, "time": time.time()}))
    runtime = make_runtime(crashed)
    with serving(runtime) as client:
        rest = events(client.get(f"/v1/streams/{req_id}?last_event_id=4").text)
        assert len(rest) == 1, rest
        assert json.loads(rest[0][1])["error"]["code"] == "cancelled"
