"""Least-frequently-used eviction with least-recently-used tie-break.

A block's frequency is 1 plus the number of prefix-cache hits it got while cached. It is kept for every cached block
(candidate or in use) and dropped when the block leaves the cache (evicted or forgotten), so the metadata never
outgrows the pool and a reused block id starts afresh.
"""

from __future__ import annotations

import heapq
import itertools

from rtxcore.contracts.eviction import EvictionPolicy
from rtxcore.hookspecs import hookimpl


class LFUPolicy(EvictionPolicy):
    """Min-heap of ``(frequency, release order, block id)``; O(log n) per operation, amortised.

    Removing a candidate only drops it from ``_entries``; its heap entry turns stale and is skipped when popped.
    The heap is rebuilt once stale entries outnumber live ones, which bounds it by about twice the capacity.
    """

    def __init__(self, capacity: int):
        super().__init__(capacity)
        self._counts: dict[int, int] = {}
        # Candidate -> sequence number of its live heap entry.
        self._entries: dict[int, int] = {}
        self._heap: list[tuple[int, int, int]] = []
        self._seq = itertools.count()

    @classmethod
    def describe(cls) -> dict[str, object]:
        return {
            "description": "least frequently hit cached block first, least recently used among equals",
            "complexity": "O(log n) amortised",
        }

    def add(self, block_id: int) -> None:
        if block_id in self._entries:
            raise ValueError(f"block {block_id} is already an eviction candidate")
        if not 0 <= block_id < self.capacity:
            raise ValueError(f"block {block_id} is outside the pool's capacity {self.capacity}")
        self._counts.setdefault(block_id, 1)
        self._push(block_id)

    def remove(self, block_id: int) -> None:
        if self._entries.pop(block_id, None) is None:
            raise ValueError(f"block {block_id} is not an eviction candidate")
        self._maybe_compact()

    def evict(self) -> int | None:
        while self._heap:
            _, seq, block_id = heapq.heappop(self._heap)
            if self._entries.get(block_id) == seq:
                del self._entries[block_id]
                del self._counts[block_id]
                return block_id
        return None

    def touch(self, block_id: int) -> None:
        if not 0 <= block_id < self.capacity:
            raise ValueError(f"block {block_id} is outside the pool's capacity {self.capacity}")
        self._counts[block_id] = self._counts.get(block_id, 1) + 1
        if block_id in self._entries:
            self._push(block_id)  # re-rank the candidate; its old entry is now stale
            self._maybe_compact()

    def forget(self, block_id: int) -> None:
        self._counts.pop(block_id, None)
        if self._entries.pop(block_id, None) is not None:
            self._maybe_compact()

    def frequency(self, block_id: int) -> int:
        """The block's current frequency; 0 for a block this policy keeps nothing about."""
        return self._counts.get(block_id, 0)

    @property
    def num_tracked_blocks(self) -> int:
        """Blocks with metadata (counts): bounded by the number of cached blocks."""
        return len(self._counts)

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, block_id: int) -> bool:
        return block_id in self._entries

    def _push(self, block_id: int) -> None:
        seq = next(self._seq)
        self._entries[block_id] = seq
        heapq.heappush(self._heap, (self._counts[block_id], seq, block_id))

    def _maybe_compact(self) -> None:
        if len(self._heap) > 2 * len(self._entries) + 32:
            self._heap = [e for e in self._heap if self._entries.get(e[2]) == e[1]]
            heapq.heapify(self._heap)


@hookimpl
def register_eviction_policies(register) -> None:
    register("lfu", LFUPolicy)
