"""Copying computed prefix-cache blocks to the first lower tier ahead of their eviction, many at a time.

Without it, each allocation that evicts cached blocks copies them down on the spot (:meth:`KVOffload.spill`): one
gather, one store and their launches per allocation, on the engine's thread, between a step's scheduling and its
launch. On an H200 at 1.5x load (W4, 48 conversations) that was 7,854 copies of a few blocks each in a 35 s load
phase, each holding the engine's thread for most of a millisecond (profiled: the launches release the GIL, and the
serving thread takes it meanwhile). Written back in batches of ``COPY_CHUNK_BLOCKS`` while the host tier has free
slots, those evictions find their block's bytes below already and cost a lookup (a spill hit). Not into a full
tier: there each store would push out a block only the tier holds for a copy of one the device still has.

Only on a GPU, and only into a host tier: on a GPU the cost is per copy (launches, events, Python), not per byte,
and a disk tier's store waits for the device (it reads the bytes back to the host at once). On a CPU each block's
bytes are a synchronous memcpy on the engine's thread, so copying blocks that may never be evicted would only add
work.

A block registered in the prefix cache while a step is being scheduled is computed by that step, so it is written
back only from the next one on: the gather is queued on the device's stream after the step that wrote it.
"""

from __future__ import annotations

from itertools import islice

from rtxcore.kv.block_pool import BlockPool
from rtxcore.kv.hashing import BlockHash
from rtxcore.kv.tiers.offload import COPY_CHUNK_BLOCKS, KVOffload

# Write back once the device pool's blocks are this full (in use or cached): below it, evictions are far off and
# the copies could be wasted.
WRITE_BACK_FROM_USAGE = 0.875
# Most chunks of COPY_CHUNK_BLOCKS copied before one step: bounds the launches a step waits for.
MAX_CHUNKS_PER_STEP = 2


class WriteBack:
    def __init__(self, offload: KVOffload, pool: BlockPool, batch_blocks: int = COPY_CHUNK_BLOCKS):
        self._offload = offload
        self._pool = pool
        self.batch_blocks = batch_blocks
        # Cached blocks not in the first lower tier whose step has been launched (oldest first: LRU evicts those
        # first), and those registered since the last launch, which the coming step computes.
        self._computed: dict[int, BlockHash] = {}
        self._cached_now: dict[int, BlockHash] = {}

    def cached(self, block_id: int, key: BlockHash) -> None:
        """``block_id`` entered the prefix cache under ``key``; the coming step computes it."""
        self._cached_now[block_id] = key

    def forget(self, block_id: int) -> None:
        """``block_id`` left the prefix cache (evicted, spilled on the spot, or its content was never computed)."""
        self._computed.pop(block_id, None)
        self._cached_now.pop(block_id, None)

    def clear(self) -> None:
        self._computed.clear()
        self._cached_now.clear()

    def before_launch(self) -> None:
        """A step's scheduling is done and it is about to be launched: copy down a batch of blocks earlier steps
        computed when due, then count this step's new blocks as computed."""
        pool = self._pool
        if (len(self._computed) >= self.batch_blocks
                and pool.num_blocks_holding_data >= WRITE_BACK_FROM_USAGE * pool.num_usable_blocks):
            blocks = self._take(MAX_CHUNKS_PER_STEP * self.batch_blocks)
            if blocks:
                self._offload.write_back(blocks)
        if self._cached_now:
            self._computed.update(self._cached_now)
            self._cached_now.clear()

    def _take(self, limit: int) -> list[tuple[int, BlockHash]]:
        """The oldest computed blocks to copy down now, as many as the tier has free slots for (up to ``limit``),
        leaving the tracking. Only into free slots: in a full tier each store would push out a block only the tier
        holds, for a copy of one the device still has (the cache's content shrinking), and a host tier over a disk
        tier would wait for the step in flight to move that block down."""
        limit = min(limit, self._offload.top.num_free_slots)
        if limit < self.batch_blocks:
            return []
        taken = list(islice(self._computed.items(), limit))
        for block_id, _ in taken:
            del self._computed[block_id]
        pool_blocks = self._pool.blocks
        return [(b, k) for b, k in taken if pool_blocks[b].block_hash == k]
