"""Reading blocks of a slow KV tier (disk) on worker threads, ahead of their reload.

A file's read and checksum take milliseconds, which on the engine's thread would hold every running request's next
step. The KV-cache manager starts the reads at a request's lookup (:meth:`BlockReads.start`) and, once they are in,
extends the request's hit with them through :meth:`~rtxcore.kv.tiers.offload.KVOffload.reload`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from rtxcore.kv.hashing import BlockHash
from rtxcore.kv.tiers.base import KVTier, TierReadError
from rtxcore.kv.tiers.offload_stats import OffloadStats

log = logging.getLogger("rtx.kv")

# Worker threads reading block files: a few reads in flight keep an NVMe queue busy; the checksum (CRC-32) releases
# the GIL for buffers this large, so they run beside the engine's thread. One pool for the process (engines come and
# go in one process; their threads should not).
READ_THREADS = 4
# Bytes of blocks being read at once, at most (pinned memory on a GPU, which torch's cache keeps): a request whose run
# goes past it reads the rest once reads in flight have ended. Computing the rest instead cost the hits: on an H100
# (W4, 128 conversations, 512 KiB blocks), a disk tier with room for every history kept a hit rate of 0.837 against
# the roomy cache's 0.934. A lookup caps its reads at the device's free blocks too (past those, blocks are computed).
PREFETCH_BYTES = 256 << 20
_readers: ThreadPoolExecutor | None = None


def _block_readers() -> ThreadPoolExecutor:
    global _readers
    if _readers is None:
        _readers = ThreadPoolExecutor(READ_THREADS, thread_name_prefix="rtx-kv-read")
    return _readers


@dataclass(eq=False, slots=True)
class Prefetch:
    """Blocks of a slow tier being read on worker threads: ``reads[i]`` reads ``keys[i]``, which stays pinned in
    ``tiers[i]`` until :meth:`BlockReads.collect` (or, after :meth:`BlockReads.drop`, the end of its read)."""

    keys: list[BlockHash]
    tiers: list[KVTier]
    reads: list[Future[torch.Tensor]]
    started_s: float
    collected: bool = False
    # Whether the blocks go up to the first tier if nobody reloads them (not after a reset of the cache).
    promote: bool = True
    # Whether the run went on past the reads started (stopped at PREFETCH_BYTES): its request reads on once these are
    # in, rather than computing what the disk holds.
    cut: bool = False

    def done(self) -> bool:
        return all(read.done() for read in self.reads)


class BlockReads:
    """The reads in flight for one offload: shared by key, capped in bytes, collected on the engine's thread."""

    def __init__(self, top: KVTier, device: torch.device, stats: OffloadStats):
        # Where blocks read for nobody go (the first lower tier), and the device the reads are staged for.
        self.top = top
        self.device = device
        self.stats = stats
        # Block reads in flight, by key: a second request for the same blocks waits for the same read.
        self._reading: dict[BlockHash, Future[torch.Tensor]] = {}
        # Prefetches nobody will collect, until their reads end (their blocks then go up to the first tier).
        self._dropped: list[Prefetch] = []

    def start(self, keys: Sequence[BlockHash], tiers: Sequence[KVTier]) -> Prefetch:
        """Start reading, on worker threads, the blocks ``KVOffload.pin_run`` pinned in tiers that read slowly
        (:attr:`KVTier.reads_in_background`); the others are unpinned. The pins of those read pass to the result:
        :meth:`collect` it once :meth:`Prefetch.done`, or :meth:`drop` it."""
        # On a GPU the reads land in pinned memory, from which the copy to the device is asynchronous.
        pin_memory = self.device.type == "cuda"
        fetch = Prefetch([], [], [], time.perf_counter())
        for i, (key, tier) in enumerate(zip(keys, tiers)):
            read = self._reading.get(key)
            if read is None:
                if not tier.reads_in_background:
                    tier.unpin(key)
                    continue
                if (len(self._reading) + 1) * tier.block_bytes > PREFETCH_BYTES:
                    # Enough in flight: this block and the rest of the run wait for a later prefetch (a hit being a
                    # run from the start, nothing after a gap is of use now).
                    for later, later_tier in zip(keys[i:], tiers[i:]):
                        later_tier.unpin(later)
                    fetch.cut = True
                    break
                read = self._reading[key] = _block_readers().submit(tier.reader(key, pin_memory))
                self.stats.num_prefetched += 1
            fetch.keys.append(key)
            fetch.tiers.append(tier)
            fetch.reads.append(read)
        return fetch

    def collect(self, fetch: Prefetch) -> dict[BlockHash, torch.Tensor]:
        """The bytes of a finished prefetch's blocks that read back intact, by key (a damaged block leaves its
        tier); its pins are released."""
        assert fetch.done(), "collect() waits for nothing: ask Prefetch.done() first"
        rows: dict[BlockHash, torch.Tensor] = {}
        if fetch.collected:
            return rows
        fetch.collected = True
        for key, tier, read in zip(fetch.keys, fetch.tiers, fetch.reads):
            if self._reading.get(key) is read:
                del self._reading[key]
            try:
                rows[key] = read.result()
            except TierReadError as exc:
                log.warning("KV block %s in the %s tier is damaged and was dropped: %s", key.hex(), tier.name, exc)
                tier.drop_damaged(key)
            except Exception as exc:  # noqa: BLE001 -- the block is only missed: the request computes it
                log.warning("could not read KV block %s from the %s tier: %r", key.hex(), tier.name, exc)
            tier.unpin(key)
        return rows

    def drop(self, fetch: Prefetch, promote: bool = True) -> None:
        """Nobody will reload a prefetch's blocks (its request left, or went ahead without them): once its reads
        end, what they read goes up to the first tier (with ``promote``, and on a CPU: on a GPU the host tier's
        buffer may still be read by uploads queued behind the step in flight, which a host write would wait for),
        where a later hit reloads it from at once."""
        if not fetch.collected:
            fetch.promote = fetch.promote and promote and self.device.type != "cuda"
            self._dropped.append(fetch)
            self.collect_dropped()

    def forget(self) -> None:
        """The cache was reset: reads in flight are shared with no later lookup, and none is promoted."""
        self._reading.clear()
        for fetch in self._dropped:
            fetch.promote = False

    def collect_dropped(self) -> None:
        """Collect the dropped prefetches whose reads ended, promoting what they read (each step)."""
        if not self._dropped:
            return
        waiting = []
        for fetch in self._dropped:
            if not fetch.done():
                waiting.append(fetch)
                continue
            rows = [(key, row) for key, row in self.collect(fetch).items() if key not in self.top]
            if rows and fetch.promote:
                self.top.store([key for key, _ in rows], torch.stack([row for _, row in rows]))
                self.stats.num_prefetches_promoted += len(rows)
        self._dropped = waiting
