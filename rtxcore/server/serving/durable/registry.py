"""The server's resumable requests: lookup by id within a tenant, ``Idempotency-Key`` claims, and retention.

Everything here runs on the servers' event loop (HTTP and gRPC share it), so the dictionaries need no lock; a claim
is taken with no
``await`` between looking a key up and reserving it, so two concurrent requests with one key never both start.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

from rtxcore.server.serving.durable.journal import Journal, JournalOptions
from rtxcore.server.serving.served_request import ServedRequest


@dataclass(slots=True)
class DurableStats:
    """Counters for metrics (event loop only)."""

    # Requests resumed in the engine from the journal at start.
    num_resumed: int = 0
    # Finished requests replayable after a restart, loaded from the journal at start.
    num_replayable: int = 0
    # GET /v1/streams/{id} answered, and POSTs attached to their request by an Idempotency-Key.
    num_stream_resumes: int = 0
    num_idempotent_replays: int = 0

log = logging.getLogger("rtx.journal")

# Retention is enforced to within this many seconds.
_PURGE_INTERVAL_S = 1.0
# An idempotency key is scoped to its tenant (None: unauthenticated).
KeyScope = tuple[str | None, str]


class DurableRequests:
    def __init__(self, journal: Journal):
        self.journal = journal
        self.options: JournalOptions = journal.options
        self._entries: dict[str, ServedRequest] = {}
        # A key maps to its request, or to a future while the request that claimed it is being admitted.
        self._keys: dict[KeyScope, ServedRequest | asyncio.Future] = {}
        # False until the journal has been replayed: until then requests are refused (503), so that a repeated
        # Idempotency-Key cannot start a second copy of a request that is about to be resumed.
        self.recovered = False
        self.stats = DurableStats()
        self._next_purge = 0.0

    def add(self, entry: ServedRequest) -> None:
        self.purge()
        self._entries[entry.req_id] = entry
        if entry.idempotency is not None:
            scope = (entry.tenant, entry.idempotency.key)
            pending = self._keys.get(scope)
            self._keys[scope] = entry
            if isinstance(pending, asyncio.Future) and not pending.done():
                pending.set_result(entry)

    def get(self, req_id: str, tenant: str | None) -> ServedRequest | None:
        """The request if it exists, is within retention and belongs to ``tenant``; None otherwise (a tenant cannot
        tell another's request from a missing one)."""
        self.purge()
        entry = self._entries.get(req_id)
        if entry is None or entry.tenant != tenant:
            return None
        return entry

    async def find_key(self, tenant: str | None, key: str) -> ServedRequest | None:
        """The request an idempotency key was used for, waiting while its first use is still being admitted;
        None when the key is free (its first use failed, or it was never used)."""
        while True:
            self.purge()
            found = self._keys.get((tenant, key))
            if not isinstance(found, asyncio.Future):
                return found
            await asyncio.shield(found)

    def claim_key(self, tenant: str | None, key: str) -> None:
        """Reserve a free key for a request about to be admitted; :meth:`add` or :meth:`release_key` ends it."""
        self._keys[(tenant, key)] = asyncio.get_running_loop().create_future()

    def release_key(self, tenant: str | None, key: str) -> None:
        """The request that claimed ``key`` was refused: the key is free again, and whoever waited on it retries."""
        pending = self._keys.pop((tenant, key), None)
        if isinstance(pending, asyncio.Future) and not pending.done():
            pending.set_result(None)

    def entries(self) -> list[ServedRequest]:
        return list(self._entries.values())

    def purge(self, now: float | None = None) -> None:
        """Forget requests finished longer ago than the retention window (a walk over all of them, so at most
        once per second)."""
        now = time.time() if now is None else now
        if now < self._next_purge:
            return
        self._next_purge = now + _PURGE_INTERVAL_S
        cutoff = now - self.options.retention_s
        for req_id, entry in list(self._entries.items()):
            if entry.finished_at is not None and entry.finished_at < cutoff:
                del self._entries[req_id]
                if entry.idempotency is not None and self._keys.get((entry.tenant, entry.idempotency.key)) is entry:
                    del self._keys[(entry.tenant, entry.idempotency.key)]

    async def stop_producers(self) -> None:
        """Cancel the requests still producing (shutdown past its grace period). They write no finish record, so
        the next start resumes them."""
        running = [e for e in self._entries.values() if e.producer is not None and not e.producer.done()]
        producers = [e.producer for e in running if e.producer is not None]
        for producer in producers:
            producer.cancel()
        await asyncio.gather(*producers, return_exceptions=True)
        for entry in running:
            if not entry.finished:
                entry.abandon()

    def close(self) -> None:
        self.journal.close()
