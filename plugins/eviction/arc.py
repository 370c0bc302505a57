"""Adaptive Replacement Cache (Megiddo and Modha, 2003) for KV blocks: scan-resistant, and self-tuning between
recency and frequency.

Every cached block is in T1 (cached once, never hit since) or T2 (hit, or its content came back after an eviction).
Keys of evicted blocks are remembered in ghost lists B1 and B2, by content key (the prefix hash the pool passes to
:meth:`cached`), not by block id: ids are reused for unrelated content, keys are not. A miss whose key is in B1
means T1 was too small, so its target ``p`` grows; a key in B2 shrinks it. Victims come from T1 while T1 is over
its target, so a long one-off prompt (a scan) passes through T1 without flushing T2's shared prefixes.

Only candidates (cached blocks nobody uses) can be victims; blocks in use stay in their list, uncounted as
candidates, and are never returned.
"""

from __future__ import annotations

from collections import OrderedDict

from rtxcore.contracts.eviction import EvictionPolicy
from rtxcore.hookspecs import hookimpl


class ARCPolicy(EvictionPolicy):
    def __init__(self, capacity: int):
        super().__init__(capacity)
        # Cached blocks -> their list (1 or 2) and key (None when the pool never named it).
        self._list: dict[int, int] = {}
        self._key: dict[int, bytes | None] = {}
        self._size = [0, 0, 0]  # cached blocks in T1 and T2 (index 1 and 2)
        # Candidates of each list, least recently used first.
        self._candidates = {1: OrderedDict(), 2: OrderedDict()}
        # Ghost keys, oldest first; together at most ``capacity``.
        self._ghosts = {1: OrderedDict(), 2: OrderedDict()}
        # Target size of T1, in blocks.
        self.p = 0.0

    @classmethod
    def describe(cls) -> dict[str, object]:
        return {"description": "ARC: recency and frequency lists with ghost keys and an adaptive split; "
                               "scan-resistant", "complexity": "O(1)"}

    def cached(self, block_id: int, key: bytes) -> None:
        self._check_id(block_id)
        b1, b2 = self._ghosts[1], self._ghosts[2]
        if key in b1:
            self.p = min(self.p + max(1.0, len(b2) / len(b1)), float(self.capacity))
            del b1[key]
            target = 2
        elif key in b2:
            self.p = max(self.p - max(1.0, len(b1) / len(b2)), 0.0)
            del b2[key]
            target = 2
        else:
            target = 1
        self._track(block_id, target)
        self._key[block_id] = key

    def add(self, block_id: int) -> None:
        self._check_id(block_id)
        if block_id in self:
            raise ValueError(f"block {block_id} is already an eviction candidate")
        if block_id not in self._list:
            self._track(block_id, 1)  # cached without the pool naming its key
        self._candidates[self._list[block_id]][block_id] = None

    def remove(self, block_id: int) -> None:
        lst = self._list.get(block_id)
        if lst is None or block_id not in self._candidates[lst]:
            raise ValueError(f"block {block_id} is not an eviction candidate")
        del self._candidates[lst][block_id]

    def touch(self, block_id: int) -> None:
        self._check_id(block_id)
        lst = self._list.get(block_id)
        if lst is None:
            self._track(block_id, 2)
            return
        is_candidate = self._candidates[lst].pop(block_id, False) is None
        if lst == 1:
            self._size[1] -= 1
            self._size[2] += 1
            self._list[block_id] = 2
        if is_candidate:
            self._candidates[2][block_id] = None

    def evict(self) -> int | None:
        t1, t2 = self._candidates[1], self._candidates[2]
        if not t1 and not t2:
            return None
        lst = 1 if t1 and (self._size[1] > self.p or not t2) else 2
        block_id, _ = self._candidates[lst].popitem(last=False)
        key = self._untrack(block_id)
        if key is not None:
            ghosts = self._ghosts[lst]
            ghosts[key] = None
            if len(self._ghosts[1]) + len(self._ghosts[2]) > self.capacity:
                # Trim the ghost list of the side that just grew past its share first, as ARC's case IV does.
                (ghosts if ghosts else self._ghosts[3 - lst]).popitem(last=False)
        return block_id

    def forget(self, block_id: int) -> None:
        if block_id in self._list:
            self._candidates[self._list[block_id]].pop(block_id, None)
            self._untrack(block_id)

    def __len__(self) -> int:
        return len(self._candidates[1]) + len(self._candidates[2])

    def __contains__(self, block_id: int) -> bool:
        lst = self._list.get(block_id)
        return lst is not None and block_id in self._candidates[lst]

    def _track(self, block_id: int, lst: int) -> None:
        old = self._list.get(block_id)
        if old is not None:
            was_candidate = self._candidates[old].pop(block_id, False) is None
            self._size[old] -= 1
            if was_candidate:
                self._candidates[lst][block_id] = None
        self._list[block_id] = lst
        self._size[lst] += 1
        self._key.setdefault(block_id, None)

    def _untrack(self, block_id: int) -> bytes | None:
        self._size[self._list.pop(block_id)] -= 1
        return self._key.pop(block_id, None)

    def _check_id(self, block_id: int) -> None:
        if not 0 <= block_id < self.capacity:
            raise ValueError(f"block {block_id} is outside the pool's capacity {self.capacity}")


@hookimpl
def register_eviction_policies(register) -> None:
    register("arc", ARCPolicy)
