"""Prefix holds of waiting requests, for schedulers: a request whose prefix is still coming back from a lower tier
steps aside and keeps its lookup's hold (the device blocks the copy lands in), and a scheduler may give such holds up
before it preempts a running request short of blocks. A hold is cheaper to give up than a running request: nothing
has been computed on it, its blocks stay in the prefix cache, and the lookup is redone when the request is retried.

Kept in the order the holds were taken, so that giving them up touches only them rather than every queue."""

from __future__ import annotations

from collections.abc import Iterator

from rtxcore.contracts.scheduler import KVCacheAllocator
from rtxcore.request import Request


class WaitingHolds:
    def __init__(self, kv_cache: KVCacheAllocator):
        self.kv_cache = kv_cache
        self._held: dict[Request, None] = {}

    def __iter__(self) -> Iterator[Request]:
        return iter(self._held)

    def add(self, req: Request) -> None:
        """``req`` steps aside, waiting, with its lookup's hold."""
        self._held[req] = None

    def forget(self, req: Request) -> None:
        """``req`` no longer waits with a hold here (it runs, or it finished)."""
        self._held.pop(req, None)

    def release(self, req: Request) -> None:
        """Drop ``req``'s lookup hold, whether kept here or not; its lookup is redone when it is retried."""
        self.kv_cache.free(req)
        req.num_computed_tokens = 0
        self._held.pop(req, None)

    def release_all_but(self, req: Request) -> bool:
        """Give up every hold of device blocks but ``req``'s; whether any was. A request whose hit is all on disk,
        still being read, holds no device block: releasing it would only cancel its reads."""
        held = [r for r in self._held if r is not req and r.num_computed_tokens > 0]
        for r in held:
            self.release(r)
        return bool(held)
