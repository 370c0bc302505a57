"""The host tier: lower-tier KV blocks in one preallocated buffer of host memory (:mod:`rtxcore.kv.tiers.base` says
what a tier is)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from rtxcore.contracts.eviction import EvictionPolicy
from rtxcore.kv.hashing import BlockHash
from rtxcore.kv.tiers.base import KVTier, LentRow, copy_host_bytes
from rtxcore.kv.tiers.row_copier import RowCopier


class HostTier(KVTier):
    """Blocks in host memory: one preallocated buffer, pinned (page-locked) where a GPU copies from it.

    With a GPU, copies between the buffer and the device run asynchronously on the device's current stream, so
    they are ordered with the steps and with each other without the engine waiting; the host waits only when it
    reads or writes the buffer itself (a copy down to disk, a snapshot, bytes that come from the host).
    """

    def __init__(self, num_slots: int, block_bytes: int, policy: EvictionPolicy, below: KVTier | None = None,
                 pin_memory: bool = False):
        super().__init__("host", num_slots, block_bytes, policy, below)
        self._buffer = torch.empty((num_slots, block_bytes), dtype=torch.uint8, pin_memory=pin_memory)
        self._pinned = pin_memory
        self._base = self._buffer.data_ptr()
        # The last queued copy into the buffer (from the device) and out of it (to the device).
        self._pending_writes: torch.cuda.Event | None = None
        self._pending_reads: torch.cuda.Event | None = None
        # Copies from the device queued since _pending_writes was recorded: a store that evicts a slot it wrote
        # earlier in the same call reads that slot before the store's own event exists.
        self._writes_unrecorded = False
        # Per slot, the event after its last copy from the device, until seen complete: a reload on the copy
        # stream waits for the slots it reads only (waiting for the last store would wait for the step in flight,
        # which the store's copies queue behind).
        self._slot_written: dict[int, torch.cuda.Event] = {}
        self._slots_unrecorded: list[int] = []
        # Copies from the device not issued yet, (slot, row), gathered over one store so that runs of consecutive
        # slots from consecutive rows go in one copy: a copy's launch costs the engine's thread several
        # microseconds, and a block is one copy otherwise.
        self._queued: list[tuple[int, torch.Tensor]] = []
        # Made at the first copy from a device (which it then knows).
        self._row_copier: RowCopier | None = None
        # Slots written by the store under way; then, per slot, its loan to the tier below (see _write_through),
        # taken back before the slot is written again.
        self._stored_now: list[tuple[int, BlockHash]] = []
        self._lent: dict[int, LentRow] = {}

    def store(self, keys: list[BlockHash], data: torch.Tensor) -> None:
        super().store(keys, data)
        if data.is_cuda:
            self._issue_queued()
            self._record_writes()
        self._write_through()

    def _write_through(self) -> None:
        """Lend the blocks this store wrote to the tier below: a disk tier's writer copies each from its slot, off
        the engine's thread, and writes its file.

        Handing a block down only at its eviction copied it aside on the engine's thread, so that its slot could take
        the next block: W4 at 128 conversations over a disk tier spent 30.9 s of an 86 s phase in stores on an
        H200. Written through, a block is on disk by the time it is evicted, and the eviction moves nothing; the
        engine's thread copies a block only when the tier cycles faster than the writer reaches it."""
        stored, self._stored_now = self._stored_now, []
        below = self.below
        if below is None or not stored:
            return
        lend = [(slot, key) for slot, key in stored if self._slot_of.get(key) == slot and key not in below]
        if not lend:
            return
        ends = below.store_borrowed([key for _, key in lend], [self._buffer[slot] for slot, _ in lend],
                                    [self._slot_written.get(slot) for slot, _ in lend])
        for (slot, _), end in zip(lend, ends):
            if end is not None:
                self._lent[slot] = end

    def _issue_queued(self) -> None:
        queued, self._queued = self._queued, []
        if not queued:
            return
        if self._row_copier is None:
            self._row_copier = RowCopier(queued[0][1].device, host_pinned=self._buffer.is_pinned())
        # One launch that writes every slot where it lies, else one copy per run of consecutive slots.
        base = self._buffer.data_ptr()
        if self._row_copier.copy([row.data_ptr() for _, row in queued],
                                 [base + slot * self.block_bytes for slot, _ in queued], self.block_bytes,
                                 [self._buffer]):
            return
        i = 0
        while i < len(queued):
            slot, row = queued[i]
            j = i + 1
            while (j < len(queued) and queued[j][0] == slot + (j - i)
                   and queued[j][1].data_ptr() == row.data_ptr() + (j - i) * self.block_bytes):
                j += 1
            source = row.as_strided((j - i, self.block_bytes), (self.block_bytes, 1))
            self._buffer[slot:slot + j - i].copy_(source, non_blocking=True)
            i = j

    def order_reads(self, stream: torch.cuda.Stream, keys: Sequence[BlockHash]) -> None:
        if self._slots_unrecorded:
            self._record_writes()
        for key in keys:
            slot = self._slot_of.get(key)
            if slot is None or slot not in self._slot_written:
                continue
            event = self._slot_written[slot]
            if event.query():
                del self._slot_written[slot]
            else:
                stream.wait_event(event)

    def _record_writes(self) -> None:
        self._pending_writes = event = _record_event()
        self._writes_unrecorded = False
        if len(self._slot_written) > self.num_slots // 2:
            self._slot_written = {slot: e for slot, e in self._slot_written.items() if not e.query()}
        for slot in self._slots_unrecorded:
            self._slot_written[slot] = event
        self._slots_unrecorded.clear()

    def note_uploads(self) -> None:
        if self._buffer.is_pinned():
            self._pending_reads = _record_event()

    def sync_for_host(self) -> None:
        if self._queued:
            self._issue_queued()
        if self._writes_unrecorded:
            self._record_writes()  # after every copy queued so far on the stream
        if self._pending_writes is not None:
            self._pending_writes.synchronize()
            self._pending_writes = None

    def sync_slot_for_host(self, slot: int) -> None:
        if slot in self._slots_unrecorded:  # written in this store: its copy is queued or issued, with no event yet
            self._issue_queued()
            self._record_writes()
        event = self._slot_written.get(slot)
        if event is not None:
            event.synchronize()

    def _write(self, slot: int, key: BlockHash, data: torch.Tensor) -> None:
        lent = self._lent.pop(slot, None)
        if lent is not None and lent.give_back():
            self.stats.num_lent_copies += 1
        self._stored_now.append((slot, key))
        if not data.is_cuda and self._pending_reads is not None:
            # A host-side write must not overtake an upload still queued from this buffer.
            self._pending_reads.synchronize()
            self._pending_reads = None
        if data.is_cuda:
            self._queued.append((slot, data))
            self._writes_unrecorded = True
            self._slots_unrecorded.append(slot)
        else:
            copy_host_bytes(self._buffer[slot], data)

    def _read(self, slot: int, key: BlockHash) -> torch.Tensor:
        if self._queued:
            self._issue_queued()
        return self._buffer[slot]

    def pinned_address(self, key: BlockHash) -> int | None:
        # An address, not a view: a view per block costs the engine's thread a torch call each (a reload reads tens).
        if not self._pinned:
            return None
        if self._queued:
            self._issue_queued()
        return self._base + self._slot_of[key] * self.block_bytes


def _record_event() -> torch.cuda.Event:
    event = torch.cuda.Event()
    event.record()
    return event
