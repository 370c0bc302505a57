"""Evicting prefix-cache blocks to the first lower tier in batches, ahead of the allocations that need their room.

Without it, every allocation that finds the free queue empty evicts what it needs on the spot and the offload
copies those few blocks down (:meth:`KVOffload.spill`): a gather, a store, their launches and events per
allocation, on the engine's thread, whatever the number of blocks. On an H200 at 1.5x load (W4, 48 conversations,
the host tier full) that was 7,914 spills of four blocks on average in a load phase, and the engine's thread is what
bounds such a phase (the device idles between steps), so each spill's fixed cost is throughput lost.

Once the device pool is nearly full, this keeps a small reserve of empty blocks: before a step is launched, when
fewer than ``low`` (half a batch) are empty, it evicts ``batch`` of the blocks the eviction policy would give up
next, in one spill. The allocations of the next steps then take empty blocks and copy nothing. What it costs: up to
``low + batch`` blocks hold nothing instead of cached content, and a hit on one of them is a reload from the tier
below rather than a device hit.

Only on a GPU over a host tier (as :mod:`rtxcore.kv.tiers.write_back`): on a CPU a block's copy is a memcpy whose
cost is its bytes, so evicting early saves nothing and may copy back what a device hit would have used.
"""

from __future__ import annotations

from rtxcore import envs
from rtxcore.kv.block_pool import BlockPool

# A pool smaller than this many batches keeps no reserve: its room is worth more as cache than as fewer spills.
MIN_POOL_BATCHES = 16


class EvictAhead:
    def __init__(self, pool: BlockPool, batch: int | None = None):
        self._pool = pool
        # At most a spill's worth (the offload gathers COPY_CHUNK_BLOCKS at a time); RTX_KV_EVICT_AHEAD by default.
        self.batch = envs.RTX_KV_EVICT_AHEAD.get() if batch is None else batch
        self.low = self.batch // 2 if self.batch and pool.num_usable_blocks >= MIN_POOL_BATCHES * self.batch else 0
        # Blocks evicted ahead, and in how many batches (for benchmarks and tests).
        self.num_evicted = 0
        self.num_batches = 0

    def before_launch(self) -> int:
        """A step's scheduling is done (its allocations made): refill the reserve of empty blocks if it ran low.
        Returns the blocks evicted. The victims' bytes are gathered on the device's stream after the steps that
        wrote them, as a spill at allocation would be."""
        pool = self._pool
        if pool.num_empty_blocks >= self.low or pool.num_evictable_blocks < self.batch:
            return 0
        evicted = pool.evict_ahead(self.batch)
        self.num_evicted += evicted
        self.num_batches += 1
        return evicted
