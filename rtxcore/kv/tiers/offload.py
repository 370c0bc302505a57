"""Moving prefix-cache blocks between the device pool and the lower tiers (host memory, then disk).

The device pool calls :meth:`KVOffload.spill` with the cached blocks it is about to reuse, before anything
overwrites them; their bytes go to the first lower tier, unless some lower tier holds them already. At admission,
the KV-cache manager asks :meth:`KVOffload.reload` for the part of a request's prefix that the device lacks but a
lower tier holds, and the blocks come back into fresh device blocks before the request's first step runs.

On a GPU a reload overlaps the steps: its bytes travel to a staging buffer on a copy stream of their own while the
steps run, and :meth:`KVOffload.complete` puts them into their blocks on the steps' stream once they have arrived (a
device-to-device copy, microseconds). Only that last copy is ordered with the steps: blocks freed while a step is in
flight may still be written by it, and the steps' stream is what orders such writes. A scheduler that asks
KVCacheManager.ready (both built-in ones do) keeps the request out of the steps until its bytes have arrived,
however few they are, so that no step waits for a copy: on the H200 (W4, 48 conversations at 1.5x load), letting
reloads of up to 64 MiB join the next step at once made 558-688 steps a load phase wait for one, and held the
offload configuration's inter-token p99 at 1.17-1.75x the roomy cache's; kept out until arrived, no step waited and
the p99 was 0.97x (docs/benchmarks.md).

Blocks on disk are read before their reload, on worker threads (:mod:`rtxcore.kv.tiers.prefetch`): a file's read and
checksum take milliseconds, which on the engine's thread would hold every running request's next step. The
KV-cache manager starts the reads at a request's lookup and extends its hit with them once they are in.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field

import torch

from rtxcore.kv.hashing import BlockHash
from rtxcore.kv.tiers.base import KVTier, TierReadError, copy_host_bytes
from rtxcore.kv.tiers.offload_stats import OffloadStats
from rtxcore.kv.tiers.prefetch import BlockReads, Prefetch
from rtxcore.kv.tiers.row_copier import RowCopier
from rtxcore.transfer import to_device

log = logging.getLogger("rtx.kv")

# Most blocks moved in one call to the backend: bounds the staging memory each copy takes on the device.
COPY_CHUNK_BLOCKS = 64
# Reload latencies kept for the metrics between two reads (a reader that stops reading loses the oldest).
_LATENCIES_KEPT = 4096
ReadBlocks = Callable[[list[int]], torch.Tensor]
WriteBlocks = Callable[[list[int], torch.Tensor], None]


@dataclass(eq=False, slots=True)
class Reload:
    """Blocks on their way back to the device: ``block_ids[i]`` receives ``keys[i]``'s bytes. ``keys`` and
    ``tiers`` are every key :meth:`KVOffload.pin_run` pinned (held until the reload completes or is cancelled)."""

    keys: list[BlockHash]
    tiers: list[KVTier]
    block_ids: list[int]
    started_s: float
    # Staged bytes on the device, one row per block, and the copy-stream event after their copy (GPU only).
    data: torch.Tensor | None = None
    copied: torch.cuda.Event | None = None
    # Rows read from a tier below the first: they also go up to the first tier on completion.
    from_below: list[int] = field(default_factory=list)
    done: bool = False

    @property
    def num_loaded(self) -> int:
        return len(self.block_ids)


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
        # Seconds from each reload's start to its bytes being in their blocks; read by the metrics.
        self.reload_seconds: deque[float] = deque(maxlen=_LATENCIES_KEPT)
        self._copy_stream: torch.cuda.Stream | None = None
        # This step's point on the device's stream before it first waited for a copy, and the copies it waited for;
        # then the same for earlier steps whose events have not all completed (read by poll()).
        self._step_wait: tuple[torch.cuda.Event, list[torch.cuda.Event]] | None = None
        self._wait_checks: list[tuple[torch.cuda.Event, list[torch.cuda.Event]]] = []
        # Host seconds this step spent copying reloads (CPU).
        self._host_copy_s = 0.0
        # Blocks of slow tiers (disk) read on worker threads ahead of their reload.
        self.reads = BlockReads(self.top, self.device, self.stats)
        self._row_copier = RowCopier(self.device)

    @property
    def top(self) -> KVTier:
        return self.tiers[0]

    def spill(self, victims: list[tuple[int, BlockHash]]) -> None:
        """The device is reusing these cached blocks: keep their bytes in a lower tier (the first, unless one
        holds them already)."""
        todo = []
        for block_id, key in victims:
            holder = self._holder(key)
            if holder is not None:
                holder.touch(key)
                self.stats.num_spill_hits += 1
            else:
                todo.append((block_id, key))
        self._copy_down(todo)
        self.stats.num_spilled += len(todo)

    def _holder(self, key: BlockHash) -> KVTier | None:
        """The highest lower tier holding ``key``. A block the disk holds is not spilled into the host tier again:
        its reload reads it from disk off the engine's thread. W4 at 48 conversations over a small host tier on an
        H100 copied 114,901 blocks down in a 61 s phase (9.5 s of the engine's thread), about half of them blocks
        the disk held (docs/benchmarks.md)."""
        for tier in self.tiers:
            if key in tier:
                return tier
        return None

    def write_back(self, blocks: list[tuple[int, BlockHash]]) -> None:
        """Copy cached blocks the device keeps to the first lower tier ahead of their eviction (see
        :mod:`rtxcore.kv.tiers.write_back`); those a lower tier holds already are left as they are (this is not a
        use)."""
        todo = [(block_id, key) for block_id, key in blocks if self._holder(key) is None]
        self._copy_down(todo)
        self.stats.num_written_back += len(todo)

    def _copy_down(self, blocks: list[tuple[int, BlockHash]]) -> None:
        """Gather the blocks on the device's stream (after the steps that wrote them) and store them in the first
        lower tier. The copies to the host stay on that stream: on one of its own, each chunk's staging buffer would
        stay reserved until that stream got to it (memory growing with a long prompt's evictions), and the host
        tier's events would cover two streams."""
        if not blocks:
            return
        started = time.perf_counter()
        # In chunks: a long prompt can evict thousands of blocks at once, and each copy stages its blocks twice on
        # the device.
        for start in range(0, len(blocks), COPY_CHUNK_BLOCKS):
            chunk = blocks[start:start + COPY_CHUNK_BLOCKS]
            self.top.store([key for _, key in chunk], self._read([block_id for block_id, _ in chunk]))
        self.stats.copy_down_host_seconds += time.perf_counter() - started

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

    def prefetch(self, keys: Sequence[BlockHash], tiers: Sequence[KVTier]) -> Prefetch:
        """See :meth:`BlockReads.start`."""
        return self.reads.start(keys, tiers)

    def collect(self, fetch: Prefetch) -> dict[BlockHash, torch.Tensor]:
        """See :meth:`BlockReads.collect`; hand the result to :meth:`reload` with the keys pinned again."""
        return self.reads.collect(fetch)

    def drop_prefetch(self, fetch: Prefetch, promote: bool = True) -> None:
        """See :meth:`BlockReads.drop`."""
        self.reads.drop(fetch, promote)

    def forget_reads(self) -> None:
        """See :meth:`BlockReads.forget`."""
        self.reads.forget()

    def reload(self, keys: Sequence[BlockHash], tiers: Sequence[KVTier], block_ids: list[int],
               fetched: dict[BlockHash, torch.Tensor] | None = None, started_s: float | None = None) -> Reload:
        """Read the first ``len(block_ids)`` pinned blocks and send them to device ``block_ids``; a damaged one
        ends the run (the blocks after it depend on it): ``num_loaded`` of the result says how many came back.
        A block in ``fetched`` (read by a :meth:`prefetch`) is not read again; ``started_s`` is then when the
        prefetch started, for the reload's latency.

        On a CPU the blocks are in place on return. On a GPU their copy runs on a copy stream: call
        :meth:`complete` before a step reads them (when :meth:`arrived` says so, it waits for nothing), or
        :meth:`cancel`. Every key :meth:`pin_run` pinned stays pinned until then.
        """
        started = time.perf_counter()
        try:
            return self._start_reload(keys, tiers, block_ids, fetched, started if started_s is None else started_s,
                                      started)
        finally:
            self.stats.reload_host_seconds += time.perf_counter() - started

    def _start_reload(self, keys: Sequence[BlockHash], tiers: Sequence[KVTier], block_ids: list[int],
                      fetched: dict[BlockHash, torch.Tensor] | None, started_s: float, started: float) -> Reload:
        if block_ids and not fetched and self._row_copier.available:
            reload = self._reload_in_place(keys, tiers, block_ids, started_s)
            if reload is not None:
                return reload
        rows: list[torch.Tensor] = []
        for key, tier in zip(keys[:len(block_ids)], tiers):
            row = fetched.get(key) if fetched else None
            if row is not None:
                tier.note_loaded(key)
                rows.append(row)
                continue
            try:
                rows.append(tier.load(key))
            except TierReadError as exc:
                log.warning("KV block %s in the %s tier is damaged and was dropped: %s", key.hex(), tier.name, exc)
                break
        n = len(rows)
        reload = Reload(list(keys), list(tiers), block_ids[:n], started_s,
                        from_below=[i for i in range(n) if tiers[i] is not self.top])
        self.stats.num_reloaded += n
        if n == 0 or self.device.type != "cuda":
            try:
                for start in range(0, n, COPY_CHUNK_BLOCKS):
                    end = min(start + COPY_CHUNK_BLOCKS, n)
                    data = torch.stack(rows[start:end]).to(self.device)
                    self._write(block_ids[start:end], data)
                    self._store_from_below(reload, data, start, end)
            finally:
                self._release(reload)
            if n:
                self._host_copy_s += time.perf_counter() - started
            return reload
        try:
            self._pin(rows, 0, n)
            # One launch that reads every row where it lies (all pinned now), else one copy per run of adjacent rows.
            staged = self._stage(keys[:n], tiers[:n], rows[0].numel(), [r.data_ptr() for r in rows], rows)
        except BaseException:
            self._release(reload)
            raise
        assert staged is not None, "with the rows given, a refused row copy copies runs instead"
        reload.data, reload.copied = staged
        return reload

    def _reload_in_place(self, keys: Sequence[BlockHash], tiers: Sequence[KVTier], block_ids: list[int],
                         started: float) -> Reload | None:
        """A GPU reload whose blocks all lie in page-locked host memory: one launch of the row copy reads them
        where they are into the staging rows, with no tensor per block. None (nothing queued, nothing counted)
        where a block is elsewhere or the row copy refuses the addresses."""
        n = len(block_ids)
        addresses = []
        for key, tier in zip(keys[:n], tiers):
            address = tier.pinned_address(key)
            if address is None:
                return None
            addresses.append(address)
        reload = Reload(list(keys), list(tiers), block_ids, started,
                        from_below=[i for i in range(n) if tiers[i] is not self.top])
        try:
            staged = self._stage(keys[:n], tiers[:n], tiers[0].block_bytes, addresses, None)
        except BaseException:
            self._release(reload)
            raise
        if staged is None:
            return None
        for key, tier in zip(keys[:n], tiers):
            tier.note_loaded(key)
        self.stats.num_reloaded += n
        reload.data, reload.copied = staged
        return reload

    def _stage(self, keys: Sequence[BlockHash], tiers: Sequence[KVTier], width: int, addresses: list[int],
               rows: list[torch.Tensor] | None) -> tuple[torch.Tensor, torch.cuda.Event] | None:
        """Queue the copy of the host rows at ``addresses`` into new staging rows on the copy stream, after any
        copy still writing those blocks into their tier; the staging rows and the event after the copy. Where the
        row copy refuses the addresses: one copy per run of adjacent ``rows``, or None (nothing queued) without."""
        stream = self._copy_stream
        if stream is None:
            stream = self._copy_stream = torch.cuda.Stream(self.device)
        for tier in set(tiers):
            tier.order_reads(stream, keys)
        with torch.cuda.stream(stream):
            data = torch.empty((len(addresses), width), dtype=torch.uint8, device=self.device)
            base = data.data_ptr()
            if not self._row_copier.copy(addresses, [base + i * width for i in range(len(addresses))], width,
                                         rows or ()):
                if rows is None:
                    return None
                _copy_runs(rows, data)
            copied = torch.cuda.Event(enable_timing=True)
            copied.record(stream)
        return data, copied

    def arrived(self, reload: Reload) -> bool:
        """Whether the reload's bytes are on the device (completing it then waits for nothing)."""
        return reload.done or reload.copied is None or reload.copied.query()

    def complete(self, reload: Reload, block_ids: Collection[int] | None = None) -> None:
        """Put a GPU reload's bytes into their blocks, queued on the current stream (after the steps queued so far,
        before the next), waiting there for the copy if it has not arrived; only the blocks in ``block_ids``
        (default: all) when some were given up meanwhile."""
        if reload.done:
            return
        started = time.perf_counter()
        try:
            assert reload.data is not None and reload.copied is not None, "only a GPU reload is pending"
            stream = torch.cuda.current_stream(self.device)
            if not reload.copied.query():
                if self._step_wait is None:
                    before = torch.cuda.Event(enable_timing=True)
                    before.record(stream)
                    self._step_wait = (before, [])
                self._step_wait[1].append(reload.copied)
                stream.wait_event(reload.copied)
            data = reload.data
            data.record_stream(stream)  # allocated on the copy stream, last used on this one
            keep = [i for i, b in enumerate(reload.block_ids) if block_ids is None or b in block_ids]
            if len(keep) == reload.num_loaded:
                self._write(reload.block_ids, data)
            elif keep:
                self._write([reload.block_ids[i] for i in keep],
                            data.index_select(0, to_device(keep, torch.long, data.device)))
            self._store_from_below(reload, data, 0, reload.num_loaded)
        finally:
            self._release(reload)
        now = time.perf_counter()
        self.reload_seconds.append(now - reload.started_s)
        self.stats.reload_host_seconds += now - started

    def end_step(self) -> None:
        """A step's reloads are all queued (called before it is launched): count it if it waited for a copy, once
        the device's timings for that are in (a later call reads them; nothing here waits for the device)."""
        self.reads.collect_dropped()
        self._row_copier.release_copied()
        for tier in self.tiers:
            tier.poll_writes()
        if self._host_copy_s:
            self.stats.num_copy_wait_steps += 1
            self.stats.copy_wait_seconds += self._host_copy_s
            self._host_copy_s = 0.0
        if self._step_wait is not None:
            self._wait_checks.append(self._step_wait)
            self._step_wait = None
        while self._wait_checks:
            before, copies = self._wait_checks[0]
            if not (before.query() and all(c.query() for c in copies)):
                break
            self._wait_checks.pop(0)
            waited_ms = max(before.elapsed_time(c) for c in copies)
            if waited_ms > 0:
                self.stats.num_copy_wait_steps += 1
                self.stats.copy_wait_seconds += waited_ms / 1000

    def cancel(self, reload: Reload) -> None:
        """Give up a pending reload: its blocks went to nobody (the staged bytes are dropped, unread)."""
        if not reload.done:
            self._release(reload)

    def _store_from_below(self, reload: Reload, data: torch.Tensor, start: int, end: int) -> None:
        """Inclusive: a block read from disk also goes to the tiers above, which reload faster."""
        rows = [i - start for i in reload.from_below if start <= i < end]
        if rows:
            self.top.store([reload.keys[start + i] for i in rows],
                           data.index_select(0, to_device(rows, torch.long, data.device)))

    def _release(self, reload: Reload) -> None:
        reload.done = True
        reload.data = None
        if self.device.type == "cuda":
            for tier in set(reload.tiers):
                tier.note_uploads()
        for key, tier in zip(reload.keys, reload.tiers):
            tier.unpin(key)
        if self.device.type != "cuda" and reload.num_loaded:
            self.reload_seconds.append(time.perf_counter() - reload.started_s)

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
            copy_host_bytes(staged[j], rows[i])
            rows[i] = staged[j]


def _copy_runs(rows: list[torch.Tensor], data: torch.Tensor) -> None:
    """Copy pinned host ``rows`` into the rows of device ``data``, one asynchronous copy per run of rows next to
    each other in one allocation (consecutive slots): each copy costs the engine's thread a torch call."""
    n, width = data.shape
    i = 0
    while i < n:
        # Adjacent addresses alone are not enough: separate pinned allocations (rows read from disk) can sit side by
        # side, and a view past one's end is out of its bounds.
        j = i + 1
        storage = rows[i].untyped_storage().data_ptr()
        while (j < n and rows[j].data_ptr() == rows[i].data_ptr() + (j - i) * width
               and rows[j].untyped_storage().data_ptr() == storage):
            j += 1
        data[i:j].copy_(rows[i].as_strided((j - i, width), (width, 1)), non_blocking=True)
        i = j
