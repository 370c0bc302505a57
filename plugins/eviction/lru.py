"""Least-recently-used eviction: the candidate released longest ago goes first."""

from __future__ import annotations

from collections import OrderedDict

from rtxcore.contracts.eviction import EvictionPolicy
from rtxcore.hookspecs import hookimpl


class LRUPolicy(EvictionPolicy):
    """Candidates in the order their last user released them; every operation is O(1)."""

    def __init__(self, capacity: int):
        super().__init__(capacity)
        # Oldest first. Values are unused: OrderedDict is the O(1) ordered set with move_to_end.
        self._candidates: OrderedDict[int, None] = OrderedDict()

    @classmethod
    def describe(cls) -> dict[str, object]:
        return {"description": "least recently used cached block first", "complexity": "O(1)"}

    def add(self, block_id: int) -> None:
        if block_id in self._candidates:
            raise ValueError(f"block {block_id} is already an eviction candidate")
        if not 0 <= block_id < self.capacity:
            raise ValueError(f"block {block_id} is outside the pool's capacity {self.capacity}")
        self._candidates[block_id] = None

    def remove(self, block_id: int) -> None:
        try:
            del self._candidates[block_id]
        except KeyError:
            raise ValueError(f"block {block_id} is not an eviction candidate") from None

    def evict(self) -> int | None:
        if not self._candidates:
            return None
        block_id, _ = self._candidates.popitem(last=False)
        return block_id

    def touch(self, block_id: int) -> None:
        # A block in use gets its recency when released (add); only a candidate's position can change here.
        if block_id in self._candidates:
            self._candidates.move_to_end(block_id)

    def forget(self, block_id: int) -> None:
        self._candidates.pop(block_id, None)

    def __len__(self) -> int:
        return len(self._candidates)

    def __contains__(self, block_id: int) -> bool:
        return block_id in self._candidates


@hookimpl
def register_eviction_policies(register) -> None:
    register("lru", LRUPolicy)
