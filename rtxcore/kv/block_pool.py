"""The pool of KV blocks: reference counts, the free queue and the hash-to-block map of the prefix cache.

Every block other than the null block is in exactly one of three states:

* **free**: no user, no cached content; in the free queue.
* **evictable**: no user, but cached (has a hash); held by the eviction policy until reused by a hit or evicted.
* **in use**: one or more users (``ref_cnt > 0``); it may also be cached and then be shared by prefix hits.

Block 0 is the **null block**: reserved, never handed out. The backend pads block tables with 0 and may point
padding slots at it, so it must never hold anyone's KV. A pool of ``num_blocks`` blocks therefore has
``num_blocks - 1`` usable ones.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Iterable

from rtxcore.contracts.eviction import EvictionPolicy
from rtxcore.errors import ConfigError, RtxError
from rtxcore.kv.hashing import BlockHash

log = logging.getLogger("rtx.kv")

NULL_BLOCK_ID = 0
# Weight of the newest allocation in the pool's pressure (an exponential moving average).
PRESSURE_ALPHA = 0.05


class BlockPoolError(RtxError, RuntimeError):
    """The pool was misused (double free, reference to a free block) or found inconsistent: a bug, not a load issue."""


@dataclass(slots=True)
class KVBlock:
    block_id: int
    # Number of requests holding the block; 0 means free or evictable.
    ref_cnt: int = 0
    # Set while the block is registered in the prefix cache.
    block_hash: BlockHash | None = None


class BlockPool:
    def __init__(self, num_blocks: int, eviction_policy: EvictionPolicy):
        if num_blocks < 2:
            raise ConfigError(f"num_blocks must be >= 2 (block 0 is reserved as the null block), got {num_blocks}")
        if eviction_policy.capacity < num_blocks:
            raise ConfigError(
                f"eviction policy capacity {eviction_policy.capacity} is smaller than the pool ({num_blocks} blocks)"
            )
        if len(eviction_policy) != 0:
            raise ConfigError("the eviction policy must start empty; build a new one per pool")
        self.num_blocks = num_blocks
        self.policy = eviction_policy
        self.blocks = [KVBlock(block_id) for block_id in range(num_blocks)]
        self._free: deque[int] = deque(range(1, num_blocks))
        self._cached: dict[BlockHash, int] = {}
        self.num_evictions = 0
        # Called with the (block id, hash) of cached blocks allocate() is about to reuse, while their KV is still
        # intact: the KV tiers copy them down instead of losing them.
        self.on_evict: Callable[[list[tuple[int, BlockHash]]], None] | None = None
        # Share of recent allocations that had to evict a cached block (see rtxcore.kv.tiers).
        self.pressure = 0.0
        # Blocks in the free queue that evict_ahead() freed and no allocation has taken yet: an allocation taking
        # one counts as having evicted (pressure).
        self._freed_ahead: set[int] = set()

    @property
    def num_usable_blocks(self) -> int:
        return self.num_blocks - 1

    @property
    def num_free_blocks(self) -> int:
        """Blocks that :meth:`allocate` can hand out now: free plus evictable."""
        return len(self._free) + len(self.policy)

    @property
    def num_empty_blocks(self) -> int:
        """Blocks in the free queue: no user and no cached content (allocating them evicts nothing)."""
        return len(self._free)

    @property
    def num_evictable_blocks(self) -> int:
        return len(self.policy)

    @property
    def num_blocks_holding_data(self) -> int:
        """Usable blocks in use or cached: everything but the free queue."""
        return self.num_usable_blocks - len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    @property
    def usage(self) -> float:
        """Fraction of usable blocks in use (evictable blocks count as unused)."""
        return 1.0 - self.num_free_blocks / self.num_usable_blocks

    def allocate(self, num_blocks: int) -> list[int] | None:
        """Hand out ``num_blocks`` empty blocks with one reference each, or ``None`` (nothing changed) if too few.

        Uncached free blocks go first; only then is the eviction policy asked for victims, whose hashes leave the map.
        """
        if num_blocks < 0:
            raise ValueError(f"num_blocks must be >= 0, got {num_blocks}")
        if num_blocks > self.num_free_blocks:
            return None
        block_ids = []
        evicted: list[tuple[int, BlockHash]] = []
        num_freed_ahead = 0
        for _ in range(num_blocks):
            if self._free:
                block = self.blocks[self._free.popleft()]
                if self._freed_ahead and block.block_id in self._freed_ahead:
                    self._freed_ahead.remove(block.block_id)
                    num_freed_ahead += 1
            else:
                block = self._evict(evicted)
            block.ref_cnt = 1
            block_ids.append(block.block_id)
        if num_blocks:
            self.pressure += PRESSURE_ALPHA * ((len(evicted) + num_freed_ahead) / num_blocks - self.pressure)
        self._on_evict(evicted)
        return block_ids

    def evict_ahead(self, num_blocks: int) -> int:
        """Evict up to ``num_blocks`` cached blocks now, in one batch, into the free queue: the allocations that
        follow then take free blocks instead of each evicting (and spilling) a few. Returns how many were evicted."""
        evicted: list[tuple[int, BlockHash]] = []
        for _ in range(min(num_blocks, len(self.policy))):
            block_id = self._evict(evicted).block_id
            self._free.append(block_id)
            self._freed_ahead.add(block_id)
        self._on_evict(evicted)
        return len(evicted)

    def _on_evict(self, evicted: list[tuple[int, BlockHash]]) -> None:
        if evicted and self.on_evict is not None:
            try:
                self.on_evict(evicted)
            except Exception:  # losing the copies costs recomputation later; losing the allocation would cost more
                log.exception("could not copy %d evicted KV blocks to a lower tier", len(evicted))

    def lookup(self, block_hash: BlockHash) -> int | None:
        """The block cached under ``block_hash``, without taking a reference."""
        return self._cached.get(block_hash)

    def cache_block(self, block_id: int, block_hash: BlockHash) -> int:
        """Register an in-use block's content under ``block_hash``; returns the block now cached for that hash.

        When another block already holds ``block_hash`` that mapping is kept (its id is returned) and ``block_id``
        stays uncached, so equal content is never indexed twice.
        """
        block = self._block(block_id)
        if block.ref_cnt == 0:
            raise BlockPoolError(f"block {block_id} is not in use; only a block being filled can be cached")
        existing = self._cached.get(block_hash)
        if existing is not None:
            return existing
        if block.block_hash is not None:
            raise BlockPoolError(f"block {block_id} is already cached under another hash")
        block.block_hash = block_hash
        self._cached[block_hash] = block_id
        self.policy.cached(block_id, block_hash)
        return block_id

    def incref(self, block_id: int) -> None:
        """Take another reference on a cached or in-use block (a prefix-cache hit)."""
        block = self._block(block_id)
        if block.ref_cnt == 0:
            if block.block_hash is None:
                raise BlockPoolError(f"block {block_id} is free; get blocks through allocate(), not incref()")
            self.policy.remove(block_id)
        if block.block_hash is not None:
            self.policy.touch(block_id)
        block.ref_cnt += 1

    def decref(self, block_id: int) -> None:
        """Drop one reference; at zero a cached block becomes evictable and an uncached one free.

        :raises BlockPoolError: the block has no reference left to drop (double free).
        """
        block = self._block(block_id)
        if block.ref_cnt <= 0:
            raise BlockPoolError(f"block {block_id} freed more times than it was referenced (double free)")
        block.ref_cnt -= 1
        if block.ref_cnt == 0:
            if block.block_hash is None:
                self._free.append(block_id)
            else:
                self.policy.add(block_id)

    def free_blocks(self, block_ids: Iterable[int]) -> None:
        """Drop one reference on each block, in the given order (which is the order they become evictable)."""
        for block_id in block_ids:
            self.decref(block_id)

    def uncache_unshared(self, block_id: int) -> None:
        """Take an in-use block out of the prefix cache if its only user holds it (its content is not what the hash
        says); a block others share stays, since they are relying on it."""
        block = self._block(block_id)
        if block.ref_cnt == 1 and block.block_hash is not None and self._cached.get(block.block_hash) == block_id:
            del self._cached[block.block_hash]
            self.policy.forget(block_id)
            block.block_hash = None

    def reset_prefix_cache(self) -> int:
        """Forget every cached hash; evictable blocks become free, blocks in use stay with their users.

        :returns: the number of blocks that left the cache.
        """
        num_dropped = len(self._cached)
        for block_id in self._cached.values():
            block = self.blocks[block_id]
            if block.ref_cnt == 0:
                self.policy.remove(block_id)
                self._free.append(block_id)
            self.policy.forget(block_id)
            block.block_hash = None
        self._cached.clear()
        self._freed_ahead.clear()
        return num_dropped

    def check_invariants(self) -> None:
        """Check the pool's bookkeeping end to end (O(num_blocks)); for tests and debugging.

        :raises BlockPoolError: naming the first inconsistency found.
        """
        null = self.blocks[NULL_BLOCK_ID]
        _require(null.ref_cnt == 0 and null.block_hash is None, "the null block was handed out or cached")
        free = set(self._free)
        _require(len(free) == len(self._free), "a block is in the free queue twice")
        _require(NULL_BLOCK_ID not in free and NULL_BLOCK_ID not in self.policy, "the null block is free/evictable")
        num_evictable = 0
        for block in self.blocks[1:]:
            bid = block.block_id
            _require(block.ref_cnt >= 0, f"block {bid} has a negative reference count {block.ref_cnt}")
            is_free = bid in free
            is_evictable = bid in self.policy
            _require(not (is_free and is_evictable), f"block {bid} is both free and evictable")
            if block.ref_cnt > 0:
                _require(not is_free and not is_evictable, f"block {bid} is in use but also free or evictable")
            elif block.block_hash is None:
                _require(is_free, f"block {bid} is unused and uncached but not in the free queue")
            else:
                _require(is_evictable, f"block {bid} is unused and cached but not evictable")
            num_evictable += is_evictable
            if block.block_hash is not None:
                _require(self._cached.get(block.block_hash) == bid, f"block {bid}'s hash does not map back to it")
        _require(num_evictable == len(self.policy), "the eviction policy holds blocks the pool does not know of")
        for block_hash, bid in self._cached.items():
            _require(self.blocks[bid].block_hash == block_hash, f"hash map entry for block {bid} is stale")

    def cached_blocks(self) -> list[tuple[int, BlockHash]]:
        """Every block in the prefix cache, in use or evictable, with its hash."""
        return [(block_id, block_hash) for block_hash, block_id in self._cached.items()]

    def _evict(self, evicted: list[tuple[int, BlockHash]]) -> KVBlock:
        block_id = self.policy.evict()
        if block_id is None or not 0 < block_id < self.num_blocks:
            raise BlockPoolError(f"eviction policy returned {block_id!r} though it reported candidates")
        block = self.blocks[block_id]
        # A policy only returns candidates it was given; checking anyway keeps a buggy plugin from corrupting KV.
        if block.ref_cnt != 0 or block.block_hash is None:
            raise BlockPoolError(f"eviction policy returned block {block_id}, which is not evictable")
        del self._cached[block.block_hash]
        evicted.append((block_id, block.block_hash))
        block.block_hash = None
        self.num_evictions += 1
        return block

    def _block(self, block_id: int) -> KVBlock:
        if not 0 < block_id < self.num_blocks:
            raise BlockPoolError(f"block id {block_id} is out of range or the reserved null block")
        return self.blocks[block_id]


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise BlockPoolError(f"block pool invariant broken: {message}")
