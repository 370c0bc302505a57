"""The journal read back, request by request: what each accepted request had produced when the server stopped.

Record types (every record has ``t``, its type, and ``id``, the request id):

- ``accept``: written and fsynced before the request is acknowledged; everything needed to run it again.
- ``out``: one engine output (``o``: choice, token ids, text, logprobs, finish reason) and/or the SSE event sent for
  it (``seq``, ``ev``: the exact payload); written before the event goes to the client.
- ``finish``: the request ended; ``status`` and ``body`` are the response of a non-streaming request.
- ``cancel``: its client cancelled it (fsynced before the cancel is acknowledged): a restart does not run it again.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger("rtx.journal")


@dataclass(slots=True)
class JournaledRequest:
    req_id: str
    accept: dict[str, Any] | None = None
    # The "o" of every out record that has one, in order.
    outputs: list[dict[str, Any]] = field(default_factory=list)
    # Event payloads by sequence number (event n is events[n - 1]).
    events: list[str] = field(default_factory=list)
    finish: dict[str, Any] | None = None
    # An event is missing (a damaged record in the middle): its stream cannot be resumed without a gap.
    damaged: bool = False
    # A cancel record: its client stopped it, though it had not finished.
    cancelled: bool = False


def group_records(records: list[dict[str, Any]]) -> list[JournaledRequest]:
    """Requests in the order they were accepted; records of a request without an intact accept record (it was never
    acknowledged, or its record was damaged) are dropped with a log line."""
    by_id: dict[str, JournaledRequest] = {}
    for record in records:
        req = by_id.setdefault(record["id"], JournaledRequest(record["id"]))
        kind = record["t"]
        if kind == "accept":
            req.accept = record
        elif kind == "out":
            if isinstance(record.get("o"), dict):
                req.outputs.append(record["o"])
            if isinstance(record.get("ev"), str):
                if record.get("seq") != len(req.events) + 1:
                    log.warning("journal: request %s event %s out of order (expected %d)", req.req_id,
                                record.get("seq"), len(req.events) + 1)
                    req.damaged = True
                if not req.damaged:
                    req.events.append(record["ev"])
        elif kind == "finish":
            req.finish = record
        elif kind == "cancel":
            req.cancelled = True
        else:
            log.warning("journal: record of unknown type %r for request %s skipped", kind, req.req_id)
    kept = []
    for req in by_id.values():
        if req.accept is None:
            log.warning("journal: request %s has no accept record; its %d other records are ignored", req.req_id,
                        len(req.outputs) + len(req.events) + (req.finish is not None))
        else:
            kept.append(req)
    return kept
