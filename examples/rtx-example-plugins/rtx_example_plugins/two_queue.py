"""A scan-resistant eviction policy after 2Q (Johnson and Shasha, 1994), for KV blocks.

Candidates whose block was never hit while cached wait in a FIFO *probation* queue; candidates that were hit (a later
request shared the prefix) wait in an LRU *protected* queue. Victims come from probation while it holds more than its
share of the candidates, so a long one-off prompt (a scan) cycles through probation without flushing the prefixes
many requests share. 2Q's ghost queue is left out: block ids are reused for unrelated content, so remembering an
evicted id says nothing about the next content it holds.
"""

from __future__ import annotations

from collections import OrderedDict

from rtxcore.contracts import EvictionPolicy
from rtxcore.hookspecs import hookimpl


class TwoQueuePolicy(EvictionPolicy):
    # Probation keeps at most this fraction of the candidates before it gives up its oldest (2Q's Kin).
    probation_share = 0.25

    def __init__(self, capacity: int):
        super().__init__(capacity)
        # Oldest first in both; values unused (OrderedDict as an ordered set with O(1) moves).
        self._probation: OrderedDict[int, None] = OrderedDict()
        self._protected: OrderedDict[int, None] = OrderedDict()
        # Cached blocks hit at least once; dropped when the block leaves the cache, so bounded by the capacity.
        self._hit: set[int] = set()

    @classmethod
    def describe(cls) -> dict[str, object]:
        return {"description": "2Q: never-hit blocks (FIFO) go before hit blocks (LRU); scan-resistant",
                "complexity": "O(1)"}

    def add(self, block_id: int) -> None:
        if block_id in self:
            raise ValueError(f"block {block_id} is already an eviction candidate")
        if not 0 <= block_id < self.capacity:
            raise ValueError(f"block {block_id} is outside the pool's capacity {self.capacity}")
        (self._protected if block_id in self._hit else self._probation)[block_id] = None

    def remove(self, block_id: int) -> None:
        for queue in (self._probation, self._protected):
            if block_id in queue:
                del queue[block_id]
                return
        raise ValueError(f"block {block_id} is not an eviction candidate")

    def touch(self, block_id: int) -> None:
        if 0 <= block_id < self.capacity:
            self._hit.add(block_id)
        if block_id in self._probation:
            del self._probation[block_id]
            self._protected[block_id] = None
        elif block_id in self._protected:
            self._protected.move_to_end(block_id)

    def evict(self) -> int | None:
        over_share = len(self._probation) > self.probation_share * len(self)
        queue = self._probation if self._probation and (over_share or not self._protected) else self._protected
        if not queue:
            return None
        block_id, _ = queue.popitem(last=False)
        self._hit.discard(block_id)
        return block_id

    def forget(self, block_id: int) -> None:
        self._probation.pop(block_id, None)
        self._protected.pop(block_id, None)
        self._hit.discard(block_id)

    def __len__(self) -> int:
        return len(self._probation) + len(self._protected)

    def __contains__(self, block_id: int) -> bool:
        return block_id in self._probation or block_id in self._protected


@hookimpl
def register_eviction_policies(register) -> None:
    register("2q", TwoQueuePolicy)
