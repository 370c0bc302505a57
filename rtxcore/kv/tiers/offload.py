"""Moving prefix-cache blocks between the device pool and the lower tiers (host memory, then disk).

The device pool calls :meth:`KVOffload.spill` with the cached blocks it is about to reuse, before anything
overwrites them; their bytes go to the first lower tier (unless it holds them already). At admission, the KV-cache
manager asks :meth:`KVOffload.reload` for the part of a request's prefix that the device lacks but a lower tier
holds, and the blocks come back into fresh device blocks before the request's first step runs.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from rtxcore.kv.hashing import BlockHash
from rtxcore.kv.tiers.base import KVTier, TierReadError
from rtxcore.transfer import to_device

log = logging.getLogger("rtx.kv")

# Most blocks moved in one call to the backend: bounds the staging memory each copy takes on the device.
COPY_CHUNK_BLOCKS = 64

ReadBlocks = Callable[[list[int]], torch.Tensor]
WriteBlocks = Callable[[list[int], torch.Tensor], None]


@dataclass(slots=True)
class OffloadStats:
    # Device blocks spilled to the first lower tier (copied), and those it already held (no copy).
    num_spilled: int = 0
    num_spill_hits: int = 0
    # Blocks brought back to the device, and the requests' tokens they covered.
    num_reloaded: int = 0


class KVOffload:
    def __init__(self, tiers: Sequence[KVTier], read_blocks: ReadBlocks, write_blocks: WriteBlocks,
                 device: torch.device | str = "cpu"):
        if not tiers:
            raise ValueError("KV offload needs at least one lower tier")
        # Top first; each tier hands what it evicts to the next.
        self.tiers = list(tiers)
        for upper, lower in zip(self.tiers, self.tiers[1:]):
            upper.below = lower
        self._read = read_blocks
        self._write = write_blocks
        # Where reloaded blocks are staged before the backend scatters them into its cache.
        self.device = torch.device(device)
        self.stats = OffloadStats()

    @property
    def top(self) -> KVTier:
        return self.tiers[0]

    def spill(self, victims: list[tuple[int, BlockHash]]) -> None:
        """The device is reusing these cached blocks: keep their bytes in the first lower tier."""
        todo = []
        for block_id, key in victims:
            if key in self.top:
                self.top.touch(key)
                self.stats.num_spill_hits += 1
            else:
                todo.append((block_id, key))
        # In chunks: a long prompt can evict thousands of blocks at once, and each copy stages its blocks twice on
        # the device.
        for start in range(0, len(todo), COPY_CHUNK_BLOCKS):
            chunk = todo[start:start + COPY_CHUNK_BLOCKS]
            self.top.store([key for _, key in chunk], self._read([block_id for block_id, _ in chunk]))
            self.stats.num_spilled += len(chunk)

    def pin_run(self, keys: Sequence[BlockHash]) -> list[KVTier]:
        """Pin the leading run of ``keys`` that some lower tier holds, each in the highest tier holding it; returns
        the tier of each pinned key. Pinned blocks stay put while the device makes room for them."""
        pinned: list[KVTier] = []
        for key in keys:
            tier = next((t for t in self.tiers if key in t), None)
            if tier is None:
                break
            tier.pin(key)
            pinned.append(tier)
        return pinned

    def reload(self, keys: Sequence[BlockHash], tiers: Sequence[KVTier], block_ids: list[int]) -> int:
        """Copy the first ``len(block_ids)`` pinned blocks into device ``block_ids``, then unpin every key
        :meth:`pin_run` pinned; returns how many leading blocks came back (a damaged one ends the run: the blocks
        after it depend on it)."""
        rows: list[torch.Tensor] = []
        try:
            for key, tier in zip(keys[:len(block_ids)], tiers):
                try:
                    rows.append(tier.load(key))
                except TierReadError as exc:
                    log.warning("KV block %s in the %s tier is damaged and was dropped: %s", key.hex(), tier.name,
                                exc)
                    break
            for start in range(0, len(rows), COPY_CHUNK_BLOCKS):
                end = min(start + COPY_CHUNK_BLOCKS, len(rows))
                if self.device.type == "cuda":
                    self._pin(rows, start, end)
                data = torch.empty((end - start, rows[start].numel()), dtype=torch.uint8, device=self.device)
                for i in range(start, end):
                    # From pinned host memory this is an asynchronous copy, ordered before the next step.
                    data[i - start].copy_(rows[i], non_blocking=True)
                self._write(block_ids[start:end], data)
                # Inclusive: a block read from disk also goes to the tiers above, which reload faster.
                from_below = [i for i in range(start, end) if tiers[i] is not self.top]
                if from_below:
                    rows_below = to_device([i - start for i in from_below], torch.long, data.device)
                    self.top.store([keys[i] for i in from_below], data.index_select(0, rows_below))
        finally:
            if self.device.type == "cuda":
                for tier in set(tiers):
                    tier.note_uploads()
            for key, tier in zip(keys, tiers):
                tier.unpin(key)
        self.stats.num_reloaded += len(rows)
        return len(rows)

    @staticmethod
    def _pin(rows: list[torch.Tensor], start: int, end: int) -> None:
        """Stage the rows of ``rows[start:end]`` that are in pageable memory (read from disk) in one pinned buffer: a
        copy to the device from pageable memory waits for the step in flight. The buffer stays reserved until
        the copies from it have run (torch's pinned-memory cache records their stream)."""
        pageable = [i for i in range(start, end) if not rows[i].is_pinned()]
        if not pageable:
            return
        staged = torch.empty((len(pageable), rows[pageable[0]].numel()), dtype=torch.uint8, pin_memory=True)
        for j, i in enumerate(pageable):
            staged[j].copy_(rows[i])
            rows[i] = staged[j]
