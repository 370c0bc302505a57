"""Copying computed prefix-cache blocks to the first lower tier ahead of their eviction, many at a time.

Without it, each allocation that evicts cached blocks copies them down on the spot (:meth:`KVOffload.spill`): one
gather, one store and their launches per allocation, on the engine's thread, between a step's scheduling and its
launch. On an H200 at 1.5x load (W4, 48 conversations) that was 7,854 copies of a few blocks each in a 35 s load
phase, about 0.7 ms of the engine's thread apiece: the difference between the offload configuration's p99 and a
cache with room for everything. Written back in batches of ``COPY_CHUNK_BLOCKS`` while the tier has free slots,
nearly every eviction finds its block's bytes below already and costs a lookup (a spill hit).

Only on a GPU: there the cost is per copy (launches, events, Python), not per byte, and the bytes travel on a copy
stream of their own. On a CPU each block's bytes are a synchronous memcpy on the engine's thread, so copying blocks
that may never be evicted would only add work.

A block registered in the prefix cache while a step is being scheduled is computed by that step, so it is written
back only from the next one on: the gather is queued on the device's stream after the step that wrote it.
"""

from __future__ import annotations

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
        if len(self._computed) >= self.batch_blocks and self._due():
            room = self._offload.top.num_free_slots
            limit = min(room, MAX_CHUNKS_PER_STEP * self.batch_blocks)
            blocks: list[tuple[int, BlockHash]] = []
            for block_id, key in self._computed.items():
                if len(blocks) >= limit:
                    break
                blocks.append((block_id, key))
            for block_id, _ in blocks:
                del self._computed[block_id]
            pool_blocks = self._pool.blocks
            self._offload.write_back([(b, k) for b, k in blocks if pool_blocks[b].block_hash == k])
        if self._cached_now:
            self._computed.update(self._cached_now)
            self._cached_now.clear()

    def _due(self) -> bool:
        pool = self._pool
        return (pool.num_blocks_holding_data >= WRITE_BACK_FROM_USAGE * pool.num_usable_blocks
                and self._offload.top.num_free_slots >= self.batch_blocks)
