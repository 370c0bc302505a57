"""Lower KV-cache tiers: where prefix-cache blocks go when the device pool reuses their blocks, instead of being
dropped, and where a later prefix hit brings them back from.

A tier is a fixed number of *slots*, each holding one block's bytes under its content key (the block's prefix
hash), with its own instance of an eviction-policy plugin choosing which slot to reuse. Tiers chain: the host tier
hands the blocks it evicts to the disk tier below it, and the disk tier drops them. Copies are *inclusive*: a block
brought back to the device keeps its copy here, so evicting it from the device again costs no copy. That, and a
slot only ever being replaced when the tier is full, is what keeps blocks from thrashing between tiers.

A tier that writes in the background (disk) can also take blocks *borrowed* (:meth:`KVTier.store_borrowed`): the tier
above lends it the rows where the bytes already lie, and takes each back (:meth:`LentRow.give_back`) before writing
there again. The host tier writes each block through to a disk tier so as it arrives: the disk tier's writer copies
it off the engine's thread, and when the host tier later evicts the block, the disk has it already and nothing moves.

A slot that is being read is *pinned*: it is not an eviction candidate until unpinned, so it never moves.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from rtxcore.contracts.eviction import EvictionPolicy
from rtxcore.errors import ConfigError, RtxError
from rtxcore.kv.block_pool import PRESSURE_ALPHA
from rtxcore.kv.hashing import BlockHash

log = logging.getLogger("rtx.kv")


def copy_host_bytes(dst: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
    """Copy one block's bytes between two host tensors (uint8, contiguous); returns ``dst``.

    Through numpy, one thread: torch splits a copy this large over its intra-op threads, and with the disk tier's
    writer and readers busy beside it a 512 KiB ``copy_`` took 611 us on the engine's thread of a 2-core machine,
    against 57 us here (benchmarks/disk_tier.py)."""
    np.copyto(dst.numpy(), src.numpy())
    return dst


def clone_host_bytes(src: torch.Tensor, pin_memory: bool = False) -> torch.Tensor:
    """A copy of one block's host bytes, as :func:`copy_host_bytes` copies them."""
    return copy_host_bytes(torch.empty(src.shape, dtype=src.dtype, pin_memory=pin_memory), src.contiguous())


class TierReadError(RtxError):
    """A block's bytes in a tier could not be read back intact (a damaged or foreign file); the block is dropped."""


@dataclass(slots=True)
class TierStats:
    # Blocks (and their bytes) written into this tier, and read back out of it to the device.
    num_stored: int = 0
    num_loaded: int = 0
    # Blocks that left this tier to make room (handed to the tier below, or dropped at the bottom).
    num_evicted: int = 0
    # Blocks that could not be stored: every slot pinned, or their write failed.
    num_rejected: int = 0
    # Blocks not stored because the tier's writes were too far behind (a disk slower than the spills).
    num_skipped_busy: int = 0
    # Blocks found damaged on read, and dropped.
    num_corrupt: int = 0
    # Blocks lent to the tier below that this tier took back before its writer had copied them, copying them on the
    # engine's thread instead (a tier cycling faster than the writes below).
    num_lent_copies: int = 0


class LentRow(Protocol):
    """A row of one tier's memory that the tier below holds on loan (:meth:`KVTier.store_borrowed`)."""

    def give_back(self) -> bool:
        """Return once the borrower no longer reads the row (it copies it now if it had not yet: then True)."""
        ...


class KVTier(ABC):
    """Slots of one tier: a key-to-slot map, a free list, pins, and an eviction policy over the slots."""

    def __init__(self, name: str, num_slots: int, block_bytes: int, policy: EvictionPolicy,
                 below: KVTier | None = None):
        if num_slots < 1:
            raise ConfigError(f"the {name} KV tier needs at least one block of room, got {num_slots}")
        if policy.capacity < num_slots or len(policy) != 0:
            raise ConfigError(f"the {name} tier's eviction policy must be new and hold {num_slots} slots")
        self.name = name
        self.num_slots = num_slots
        self.block_bytes = block_bytes
        self.policy = policy
        self.below = below
        self.stats = TierStats()
        # Bumped whenever a block enters or leaves: what an index of the tier's content must keep up with.
        self.num_changes = 0
        # Share of recent insertions that had to evict something: 0 while there is room, 1 when every new block
        # pushes an old one out.
        self.pressure = 0.0
        self._slot_of: dict[BlockHash, int] = {}
        self._key_of: list[BlockHash | None] = [None] * num_slots
        self._pins = [0] * num_slots
        self._free = list(range(num_slots - 1, -1, -1))

    def __contains__(self, key: BlockHash) -> bool:
        return key in self._slot_of

    def __len__(self) -> int:
        return len(self._slot_of)

    @property
    def usage(self) -> float:
        return len(self._slot_of) / self.num_slots

    @property
    def num_free_slots(self) -> int:
        return len(self._free)

    @property
    def capacity_bytes(self) -> int:
        return self.num_slots * self.block_bytes

    def keys(self) -> list[BlockHash]:
        return list(self._slot_of)

    def holds(self, key: BlockHash) -> bool:
        """Whether this tier or one below holds ``key``."""
        return key in self._slot_of or (self.below is not None and self.below.holds(key))

    def touch(self, key: BlockHash) -> None:
        slot = self._slot_of.get(key)
        if slot is not None:
            self.policy.touch(slot)

    def store(self, keys: list[BlockHash], data: torch.Tensor) -> None:
        """Put blocks (uint8 rows of ``data``) under ``keys``; a key already here is only touched."""
        for key, row in zip(keys, data):
            if key in self._slot_of:
                self.touch(key)
                continue
            if self.busy():  # asked before a slot is taken: taking one may push a block out for nothing
                self.stats.num_skipped_busy += 1
                continue
            slot = self._take_slot()
            if slot is None:
                self.stats.num_rejected += 1
                continue
            try:
                self._write(slot, key, row)
            except OSError as exc:  # a full or failing disk costs this block, never the engine
                log.warning("could not store KV block %s in the %s tier: %s", key.hex(), self.name, exc)
                self._free.append(slot)
                self.stats.num_rejected += 1
                continue
            self._slot_of[key] = slot
            self._key_of[slot] = key
            self.policy.cached(slot, key)
            self.policy.add(slot)
            self.stats.num_stored += 1
            self.num_changes += 1

    def store_borrowed(self, keys: list[BlockHash], rows: list[torch.Tensor],
                       ready: list[torch.cuda.Event | None]) -> list[LentRow | None]:
        """Store blocks from rows the caller lends: ``ready[i]`` (when given) completes once ``rows[i]``'s bytes are
        there, and the caller writes that row again only after the returned loan's :meth:`LentRow.give_back`. None
        where the block was not taken so (the row is free at once). By default none is: a tier that copies at once
        gains nothing by it."""
        return [None] * len(keys)

    def busy(self) -> bool:
        """Whether the tier's writes are too far behind to take a block now (False by default: a tier in memory
        stores at once)."""
        return False

    def pin(self, key: BlockHash) -> bool:
        """Hold ``key``'s slot in place (no eviction) until :meth:`unpin`; False when the tier lacks it."""
        slot = self._slot_of.get(key)
        if slot is None:
            return False
        if self._pins[slot] == 0:
            self.policy.remove(slot)
        self._pins[slot] += 1
        return True

    def unpin(self, key: BlockHash) -> None:
        slot = self._slot_of.get(key)
        # None: dropped while pinned (it failed to read back or to be written). 0: dropped, then stored again
        # before this holder let go; the new copy was never this holder's.
        if slot is None or self._pins[slot] == 0:
            return
        self._pins[slot] -= 1
        if self._pins[slot] == 0:
            self.policy.add(slot)

    def peek(self, key: BlockHash) -> torch.Tensor:
        """A block's bytes without counting a use (copies for a snapshot must not reorder the policy's queues).

        :raises TierReadError: as :meth:`load`, without dropping the block.
        """
        return self._read(self._slot_of[key], key)

    def load(self, key: BlockHash) -> torch.Tensor:
        """The bytes of a pinned block.

        :raises TierReadError: they could not be read back intact; the block has left the tier (and its pin).
        """
        try:
            data = self._read(self._slot_of[key], key)
        except TierReadError:
            self.drop_damaged(key)
            raise
        self.note_loaded(key)
        return data

    def pinned_address(self, key: BlockHash) -> int | None:
        """Where a pinned block's bytes lie in page-locked host memory, for a GPU to read them in place (a use to
        count with :meth:`note_loaded`); None where they are not in such memory (this default)."""
        return None

    # Whether reading a block takes long enough (a file) that the engine's thread should not wait for it: the
    # offload then reads it on a worker thread through reader() (KVOffload.prefetch).
    reads_in_background = False

    def reader(self, key: BlockHash, pin_memory: bool) -> Callable[[], torch.Tensor]:
        """A call that reads a pinned block's bytes on any thread (in pinned memory if asked), as :meth:`load` does
        but touching nothing else in the tier; it raises :class:`TierReadError`. Asked on the engine's thread.

        This default reads at once, on the asking thread (a fast tier's read costs less than handing it over), and
        the call hands over a copy of the bytes; a tier that :attr:`reads_in_background` reads in the call."""
        data = clone_host_bytes(self._read(self._slot_of[key], key), pin_memory)
        return lambda: data

    def note_loaded(self, key: BlockHash) -> None:
        """``key``'s bytes were read out for the device (by :meth:`load` or a :meth:`reader`): a use."""
        slot = self._slot_of.get(key)
        if slot is not None:
            self.policy.touch(slot)
            self.stats.num_loaded += 1

    def drop_damaged(self, key: BlockHash) -> None:
        """``key``'s bytes could not be read back intact: it leaves the tier, whoever pinned it."""
        if key in self._slot_of:
            self.stats.num_corrupt += 1
            self.forget(key)

    def forget(self, key: BlockHash) -> None:
        """``key`` leaves the tier at once, whoever pinned it (their unpin is then a no-op)."""
        slot = self._slot_of.get(key)
        if slot is not None:
            self._pins[slot] = 0
            self._discard(slot)

    def poll_writes(self) -> None:  # noqa: B027 -- a no-op default, as sync_for_host
        """Account for writes into this tier that ended (each step): only a tier written in the background has any."""

    def clear(self) -> int:
        """Drop every block not pinned (the prefix cache was reset: their content may be stale); returns how many."""
        dropped = [slot for slot in self._slot_of.values() if self._pins[slot] == 0]
        for slot in dropped:
            self._discard(slot)
        return len(dropped)

    def check_invariants(self) -> None:
        """Every key in exactly one slot, pinned slots never candidates, the policy holding exactly the unpinned
        occupied slots; for tests."""
        assert len(self._slot_of) + len(self._free) == self.num_slots, "a slot is lost or counted twice"
        assert len(set(self._free)) == len(self._free), "a slot is free twice"
        for key, slot in self._slot_of.items():
            assert self._key_of[slot] == key, f"slot {slot} does not map back to its key"
            assert slot not in self._free, f"occupied slot {slot} is also free"
            assert (slot in self.policy) == (self._pins[slot] == 0), f"slot {slot}'s pin and candidacy disagree"
        assert len(self.policy) == sum(1 for s in self._slot_of.values() if self._pins[s] == 0)

    def _take_slot(self) -> int | None:
        if self._free:
            self._note_pressure(0.0)
            return self._free.pop()
        slot = self.policy.evict()
        if slot is None:
            return None
        self._note_pressure(1.0)
        key = self._key_of[slot]
        assert key is not None, "the policy's candidates are occupied slots: they all hold a key"
        if self.below is not None and key in self.below:
            self.below.touch(key)  # written through earlier: leaving this tier is its use there, as a store's is
        elif self.below is not None:
            try:
                self.sync_slot_for_host(slot)
                self.below.store([key], self._read(slot, key).unsqueeze(0))
            except TierReadError:
                self.stats.num_corrupt += 1
        self.stats.num_evicted += 1
        self.num_changes += 1
        del self._slot_of[key]
        self._key_of[slot] = None
        self._drop(slot, key)
        return slot

    def _discard(self, slot: int) -> None:
        key = self._key_of[slot]
        assert key is not None, "only occupied slots (values of _slot_of) are discarded"
        if slot in self.policy:
            self.policy.remove(slot)
        self.policy.forget(slot)
        del self._slot_of[key]
        self._key_of[slot] = None
        self._drop(slot, key)
        self._free.append(slot)
        self.num_changes += 1

    # Does nothing by default on purpose (like _drop and note_uploads): only a tier with asynchronous copies
    # overrides it, so it is not abstract.
    def sync_for_host(self) -> None:  # noqa: B027
        """Wait for copies still writing into this tier, before the host reads its bytes (for another tier or a
        snapshot); readers on the device's stream need no wait."""

    def sync_slot_for_host(self, slot: int) -> None:
        """As :meth:`sync_for_host`, for one slot's bytes only (an eviction reads one slot: waiting for every copy
        into the tier would wait for the step in flight, which the latest copies queue behind)."""
        self.sync_for_host()

    def note_uploads(self) -> None:  # noqa: B027 -- a no-op default, as sync_for_host
        """Rows :meth:`load` returned were queued for an asynchronous copy to the device."""

    def order_reads(self, stream: torch.cuda.Stream, keys: Sequence[BlockHash]) -> None:  # noqa: B027
        """Make ``stream`` wait for copies from the device still writing these keys' bytes here, before it copies
        them out (a no-op default, as sync_for_host: only a tier written asynchronously needs it)."""

    def _note_pressure(self, evicted: float) -> None:
        self.pressure += PRESSURE_ALPHA * (evicted - self.pressure)

    @abstractmethod
    def _write(self, slot: int, key: BlockHash, data: torch.Tensor) -> None:
        """Store one block's bytes in ``slot``."""

    @abstractmethod
    def _read(self, slot: int, key: BlockHash) -> torch.Tensor:
        """One block's bytes from ``slot`` (uint8 [block_bytes]); raises :class:`TierReadError`."""

    def _drop(self, slot: int, key: BlockHash) -> None:  # noqa: B027 -- a no-op default, as sync_for_host
        """``key`` left ``slot``: release whatever storage it had beyond the slot."""
