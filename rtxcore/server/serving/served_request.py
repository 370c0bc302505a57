"""One request as the server keeps it while it is served (and, with a journal, for its retention window after):
every event produced so far, in order, and how it ended.

Events are numbered from 1 (the SSE ``id``, the gRPC ``event_id``); a client that saw event ``n`` resumes after it
and gets events ``n+1...`` from :meth:`ServedRequest.follow`, the ones already produced replayed from memory, the
rest as they come. The producer appends an event only after it is in the journal, so no client is ever ahead of the
journal.
"""

from __future__ import annotations

import asyncio
import secrets
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator

from rtxcore.errors import RequestError


def new_request_id() -> str:
    return f"rq-{secrets.token_hex(12)}"


@dataclass(slots=True)
class IdempotencyClaim:
    """An ``Idempotency-Key`` and what it was first used for: a repeat must be the same request."""

    key: str
    # SHA-256 of the route and the canonical JSON body.
    fingerprint: str


@dataclass(slots=True, eq=False)
class ServedRequest:
    # The x-rtx-request-id header, the id of GET /v1/streams/{request_id} and of gRPC's Resume.
    req_id: str
    # Only this tenant may resume it (None: the server is unauthenticated).
    tenant: str | None
    stream: bool
    idempotency: IdempotencyClaim | None = None
    # Whether its SSE stream ends with a ``data: [DONE]`` event (OpenAI routes; /generate's last event says
    # ``finished`` instead).
    ends_with_done: bool = True
    # Its response format (a key of rtxcore.server.serving.formats.FORMATS): "grpc" for a gRPC Generate.
    kind: str = ""
    accepted_at: float = field(default_factory=time.time)
    # JSON payloads of the events produced so far; event n is events[n - 1].
    events: list[str] = field(default_factory=list)
    # Set when it finished: what it failed with (None: it succeeded), and a non-streaming request's response.
    error: RequestError | None = None
    final_body: dict[str, Any] | None = None
    finished_at: float | None = None
    # The task producing its events (None once it ends or for one replayed from the journal).
    producer: asyncio.Task | None = None
    # Set when this process stops producing it unfinished (shutdown): followers stop waiting; the next start resumes.
    abandoned: bool = False
    # Its Generation while one runs it (rtxcore.server.serving.generation; Any: that module imports this one).
    generation: Any = None
    # Its client cancelled it (DELETE /v1/streams/{id}, gRPC Cancel): a generation started later is cancelled too.
    cancel_requested: bool = False
    _changed: asyncio.Event | None = None

    @property
    def finished(self) -> bool:
        return self.finished_at is not None

    @property
    def last_seq(self) -> int:
        return len(self.events)

    def add_event(self, payload: str) -> int:
        self.events.append(payload)
        self._wake()
        return len(self.events)

    def finish(self, error: RequestError | None, body: dict[str, Any] | None, at: float | None = None) -> None:
        self.error, self.final_body = error, body
        self.finished_at = time.time() if at is None else at
        self._wake()

    async def follow(self, after_seq: int = 0) -> AsyncIterator[tuple[int, str]]:
        """``(seq, payload)`` of every event after ``after_seq``, replayed then live, until the request finishes
        (or is abandoned: then it ends unfinished)."""
        seq = after_seq
        while True:
            changed = self._event()
            while seq < len(self.events):
                seq += 1
                yield seq, self.events[seq - 1]
            if self.finished or self.abandoned:
                return
            await changed.wait()

    def abandon(self) -> None:
        self.abandoned = True
        self._wake()

    async def wait_finished(self) -> None:
        """Until it finishes, or this process stops producing it (abandoned: the next start resumes it)."""
        while not self.finished and not self.abandoned:
            await self._event().wait()

    def _event(self) -> asyncio.Event:
        if self._changed is None:
            self._changed = asyncio.Event()
        return self._changed

    def _wake(self) -> None:
        # A fresh event per change: followers wait on the one they saw before reading, so none misses a change.
        changed, self._changed = self._changed, None
        if changed is not None:
            changed.set()
