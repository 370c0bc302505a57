"""Eviction-policy contract: which cached, unused KV block to reuse when the pool runs out of empty blocks.

The block pool owns the blocks. It tells the policy when a cached block stops being used (a candidate), when a
candidate is used again (no longer a candidate), and asks for a victim only when it needs a block. A policy only
ever returns a current candidate, so it can never evict a block in use.

With KV tiers (``rtxcore.kv.tiers``) each tier has its own instance of a policy: the device pool, the host-memory
tier and the disk tier. Ids are then that tier's slots, and ``capacity`` its number of slots. A block keeps its
content key (the prefix hash) when it moves between tiers, which :meth:`EvictionPolicy.cached` passes on: a policy
that remembers keys after evicting them (2Q's and ARC's ghost lists) recognises content it has seen before.
"""

from __future__ import annotations

from abc import ABC, abstractmethod


class EvictionPolicy(ABC):
    def __init__(self, capacity: int):
        """:param capacity: the number of blocks in the pool; metadata must stay within O(capacity)."""
        self.capacity = capacity

    @abstractmethod
    def add(self, block_id: int) -> None:
        """A cached block's last user released it: it becomes a candidate for eviction."""

    @abstractmethod
    def remove(self, block_id: int) -> None:
        """A candidate was taken back into use (a prefix-cache hit): it is no longer a candidate."""

    @abstractmethod
    def evict(self) -> int | None:
        """Choose a candidate, forget it and return its id; ``None`` when there is none."""

    def touch(self, block_id: int) -> None:
        """A cached block was hit (used again). Recency/frequency policies update their state; default ignores."""

    def cached(self, block_id: int, key: bytes) -> None:
        """The block now holds the content named ``key`` (its prefix hash), the same key in every tier; called before
        the block is first released. Policies that keep no history ignore it."""

    def forget(self, block_id: int) -> None:
        """The block left the cache for another reason (e.g. reset); drop any metadata kept for it."""

    @abstractmethod
    def __len__(self) -> int:
        """Number of current candidates."""

    @abstractmethod
    def __contains__(self, block_id: int) -> bool:
        """Whether ``block_id`` is a current candidate."""
