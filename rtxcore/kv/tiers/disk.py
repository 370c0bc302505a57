"""The disk KV tier: one file per block under a directory, which outlives the process (the warm-restart snapshot
is this tier plus an index, see ``rtxcore.kv.tiers.snapshot``).

Each file starts with a header naming what it holds: a magic string, the *cache fingerprint* (model weights and
shape, backend, dtype and block size: what makes two servers' KV bytes interchangeable), the block's key, its
length and a checksum of the bytes. A file whose header or checksum does not match is never loaded; it is deleted
and the block counts as missing.

Files are written to a temporary name and renamed, so a crash leaves either the whole file or none. They are not
fsynced one by one: losing a cache entry to a power cut costs a recomputation, not correctness. The storage calls
are the only thing that knows about files, to leave room for NVMe queues or GPUDirect Storage behind the same tier.

Writes and removals run on writer threads of their own, each key's in the order they were asked (a block removed and
stored again ends as stored), so that a spill never holds the engine's thread for a file. The host tier above lends
each block it takes (it writes through, :meth:`DiskTier.store_borrowed`): the writer copies the bytes out of the
host's slot, then checksums and writes them; the engine's thread copies them only when the host tier needs that slot
again before the writer got to it. A block handed down otherwise is copied aside on the engine's thread. Until a
block's write has ended, reads of it are served from those bytes. A write that fails (a full disk) costs that block
once noticed (:meth:`DiskTier.poll_writes`, every step); :meth:`DiskTier.flush` waits for them all (before a
snapshot's index).
A disk slower than the spills is not waited for either: past ``WRITE_BACKLOG_BYTES`` of writes not yet done, a block
is not stored (it is recomputed if asked for again), so that a slow disk costs hits, never the running requests'
steps.
"""

from __future__ import annotations

import logging
import struct
import threading
import zlib
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from functools import partial
from pathlib import Path

import torch

from rtxcore.contracts.eviction import EvictionPolicy
from rtxcore.files import replace_atomically
from rtxcore.kv.hashing import HASH_SIZE, BlockHash
from rtxcore.kv.tiers.base import KVTier, LentRow, TierReadError, clone_host_bytes

log = logging.getLogger("rtx.kv")

# 02: a CRC-32 of the bytes where 01 had a blake2b digest (a 01 file fails the magic check and is removed).
MAGIC = b"RTXKVB02"
FINGERPRINT_SIZE = 20
# magic, fingerprint, key, payload length, payload checksum
_HEADER = struct.Struct(f"<8s{FINGERPRINT_SIZE}s{HASH_SIZE}sQI")
SUFFIX = ".kvb"
# Bytes of blocks waiting for their file (held in memory meanwhile): past this, blocks are not stored until the writer
# catches up. Waiting for it instead held every running request: on an H100 (W4, 128 conversations over a disk tier)
# the engine's thread spent 84 s of a 151 s load phase in stores, and TTFT p99 was 6x the roomy cache's.
WRITE_BACKLOG_BYTES = 256 << 20
# Writer threads for the process (engines come and go in one process; their threads should not). A key's file
# operations always go to the same thread, so they run in the order they were asked (a block removed and stored again
# ends as stored); several threads, because one thread's checksums and copies bounded the blocks a second it wrote.
WRITE_THREADS = 4
_file_ops: list[ThreadPoolExecutor] = []


def _queue_file_op(writer: int, fn: Callable, *args) -> Future:
    if not _file_ops:
        _file_ops.extend(ThreadPoolExecutor(1, thread_name_prefix=f"rtx-kv-write-{i}") for i in range(WRITE_THREADS))
    return _file_ops[writer].submit(fn, *args)


def checksum(data: bytes | memoryview) -> int:
    """CRC-32: it finds a torn or damaged file (the header names the block, so a misplaced one fails anyway) at
    5 GB/s on one core, where blake2b ran at 0.9 (0.56 on the GPU machine's cores), which bounded the disk tier's
    writer thread below W4's spill rate at 128 conversations (benchmarks/disk_tier.py). zlib releases the GIL."""
    return zlib.crc32(data)


class DiskTier(KVTier):
    def __init__(self, root: Path, num_slots: int, block_bytes: int, policy: EvictionPolicy, fingerprint: bytes):
        super().__init__("disk", num_slots, block_bytes, policy)
        if len(fingerprint) != FINGERPRINT_SIZE:
            raise ValueError(f"fingerprint must be {FINGERPRINT_SIZE} bytes")
        self.root = root
        self.fingerprint = fingerprint
        self.blocks_dir = root / "blocks"
        self.blocks_dir.mkdir(parents=True, exist_ok=True)
        # Blocks whose write has not been seen to end, with the file's bytes (served to reads meanwhile); the writes
        # in the order they were queued, with their sizes (accounted as the oldest end: a conservative backlog).
        self._writing: dict[BlockHash, _Writing] = {}
        self._writes: deque[tuple[BlockHash, _Writing, int]] = deque()
        self._backlog_bytes = 0
        self._storing_all = False
        # Within store_borrowed: each lent key's event (None: its bytes are there), and the loans it took.
        self._lending: dict[BlockHash, torch.cuda.Event | None] | None = None
        self._lent: dict[BlockHash, _Writing] = {}
        # The last file operation queued on each writer thread (what flush waits for).
        self._last_ops: dict[int, Future] = {}
        # Within a store: the file operations it asks for, per writer thread, handed over together when it ends.
        self._batches: dict[int, _Batch] | None = None

    def store(self, keys: list[BlockHash], data: torch.Tensor) -> None:
        with self._batched():
            super().store(keys, data.cpu())  # one copy from the device for the batch, not one per file

    def path(self, key: BlockHash) -> Path:
        name = key.hex()
        return self.blocks_dir / name[:2] / (name + SUFFIX)

    def adopt(self, key: BlockHash) -> bool:
        """Take an existing file into the tier (a warm start) if its header names this cache and key; a file that
        does not match is deleted. False when it was not taken (no room, missing, or foreign)."""
        if key in self or not self._free:
            return False
        path = self.path(key)
        try:
            with open(path, "rb") as fh:
                header = fh.read(_HEADER.size)
            self._check_header(header, key)
        except FileNotFoundError:
            return False
        except (OSError, TierReadError) as exc:
            log.warning("dropping KV block file %s: %s", path, exc)
            path.unlink(missing_ok=True)
            return False
        slot = self._free.pop()
        self.num_changes += 1
        self._slot_of[key] = slot
        self._key_of[slot] = key
        self.policy.cached(slot, key)
        self.policy.add(slot)
        return True

    def files(self) -> list[Path]:
        return sorted(self.blocks_dir.glob(f"*/*{SUFFIX}"))

    def _queue(self, key: BlockHash, fn: Callable, *args) -> Future:
        """Run ``fn(*args)`` on ``key``'s writer thread after every operation asked for before it; the future ends
        with it (within a store, with the store's operations on that thread)."""
        writer = key[0] % WRITE_THREADS  # a key's operations always on the same writer
        if self._batches is not None:
            batch = self._batches.get(writer)
            if batch is None:
                batch = self._batches[writer] = _Batch()
            batch.ops.append(partial(fn, *args))
            return batch.done
        op = self._last_ops[writer] = _queue_file_op(writer, fn, *args)
        return op

    @contextmanager
    def _batched(self) -> Iterator[None]:
        """The file operations a store asks for go to each writer thread as one task when it ends: a task per block
        cost the engine's thread a future, a queue lock and a wake-up each (a fifth of a spill's time there)."""
        if self._batches is not None:
            yield
            return
        self._batches = {}
        try:
            yield
        finally:
            self._hand_over()
            self._batches = None

    def _hand_over(self) -> None:
        """Queue what the store under way asked for so far (at its end, or when it must wait for its own writes)."""
        if self._batches:
            for writer, batch in self._batches.items():
                self._last_ops[writer] = _queue_file_op(writer, batch.run)
            self._batches = {}

    def busy(self) -> bool:
        self.poll_writes()
        while self._storing_all and self._backlog_bytes + self.block_bytes > WRITE_BACKLOG_BYTES and self._writes:
            self._hand_over()  # the oldest write may be this very store's
            self._writes[0][1].write.result()
            self.poll_writes()
        return self._backlog_bytes + self.block_bytes > WRITE_BACKLOG_BYTES

    @contextmanager
    def storing_all(self) -> Iterator[None]:
        """Within it, a store waits for the writer to catch up instead of leaving blocks out: for a snapshot, which
        must hold every block it is given."""
        self._storing_all = True
        try:
            yield
        finally:
            self._storing_all = False

    def store_borrowed(self, keys: list[BlockHash], rows: list[torch.Tensor],
                       ready: list[torch.cuda.Event | None]) -> list[LentRow | None]:
        self._lending, self._lent = dict(zip(keys, ready)), {}
        try:
            with self._batched():
                super().store(keys, rows)  # type: ignore[arg-type]  # rows, one by one, as a tensor's
        finally:
            self._lending = None
        lent, self._lent = self._lent, {}
        return [lent.get(key) for key in keys]

    def _write(self, slot: int, key: BlockHash, data: torch.Tensor) -> None:
        if self._lending is not None:  # the lender's row, until the writer (or give_back) copies it
            writing = _Writing(data, self._lending[key])
            self._lent[key] = writing
        else:  # its own bytes: the caller reuses its rows at once
            writing = _Writing(clone_host_bytes(data), None, borrowed=False)
        writing.write = self._queue(key, self._write_file, key, writing)
        self._writing[key] = writing
        self._writes.append((key, writing, data.numel()))
        self._backlog_bytes += data.numel()

    def _write_file(self, key: BlockHash, writing: _Writing) -> None:
        """On the writer thread: the block's bytes made its own (a borrowed row is copied first), the header with
        the checksum, and the file. The bytes go to the file from where they lie: copying them into one ``bytes``
        with the header held the GIL for two 512 KiB copies a block, which the engine's thread waited for (the
        copy, the checksum and the writes release it)."""
        writing.give_back()
        payload = writing.row.numpy().data
        header = _HEADER.pack(MAGIC, self.fingerprint, key, len(payload), checksum(payload))
        path = self.path(key)
        try:
            path.parent.mkdir(exist_ok=True)
            replace_atomically(path, (header, payload), durable=False)
        except OSError as exc:  # kept, not raised: poll_writes reads it on the engine's thread
            writing.error = exc

    def poll_writes(self) -> None:
        """Account for the writes that have ended: a failed one's block leaves the tier (a full or failing disk
        costs that block, never the engine)."""
        while self._writes and self._writes[0][1].write.done():
            key, writing, num_bytes = self._writes.popleft()
            self._backlog_bytes -= num_bytes
            if self._writing.get(key) is not writing:
                continue  # removed (or stored again) since: this write's outcome no longer matters
            del self._writing[key]
            error = writing.error
            if error is not None and key in self:
                log.warning("could not store KV block %s in the %s tier: %s", key.hex(), self.name, error)
                self.stats.num_rejected += 1
                self.forget(key)

    def flush(self) -> None:
        """Wait until every file operation asked so far has ended, and account for them."""
        for op in self._last_ops.values():
            op.result()
        self._last_ops.clear()
        self.poll_writes()

    # A block file is read and checked in milliseconds (a page-cache hit still copies and hashes it): too long for
    # the engine's thread, which would hold every running request's next step meanwhile.
    reads_in_background = True

    def reader(self, key: BlockHash, pin_memory: bool) -> Callable[[], torch.Tensor]:
        # The path is fixed while the key is pinned; the call reads only the file and the tier's constants.
        writing = self._writing.get(key)
        if writing is not None:
            writing.give_back()  # a copy of its own: the lender may write its row before this read runs
            return partial(clone_host_bytes, writing.row, pin_memory)
        return partial(self._read_file, self.path(key), key, pin_memory)

    def _read(self, slot: int, key: BlockHash) -> torch.Tensor:
        writing = self._writing.get(key)
        if writing is not None:
            writing.give_back()
            return writing.row
        return self._read_file(self.path(key), key, False)

    def _read_file(self, path: Path, key: BlockHash, pin_memory: bool) -> torch.Tensor:
        try:
            with open(path, "rb") as fh:
                header = fh.read(_HEADER.size)
                length = self._check_header(header, key)
                if length != self.block_bytes:
                    raise TierReadError(f"{path} says it holds {length} bytes, expected {self.block_bytes}")
                # Straight into the (pinned, where asked) tensor that the copy to the device reads.
                data = torch.empty(length, dtype=torch.uint8, pin_memory=pin_memory)
                view = data.numpy().data
                num_read = fh.readinto(view)
                trailing = fh.read(1)
        except OSError as exc:
            raise TierReadError(f"cannot read {path}: {exc}") from None
        if num_read != length or trailing:
            raise TierReadError(f"{path} holds {'more' if trailing else num_read} bytes, expected {length}")
        if checksum(view) != _HEADER.unpack(header)[4]:
            raise TierReadError(f"{path} fails its checksum")
        return data

    def _drop(self, slot: int, key: BlockHash) -> None:
        self._writing.pop(key, None)
        self._queue(key, _remove_file, self.path(key))  # after its write, if that is still queued

    def _check_header(self, header: bytes, key: BlockHash) -> int:
        if len(header) != _HEADER.size:
            raise TierReadError("the file is shorter than its header")
        magic, fingerprint, file_key, length, _ = _HEADER.unpack(header)
        if magic != MAGIC:
            raise TierReadError("not a KV block file (bad magic)")
        if fingerprint != self.fingerprint:
            raise TierReadError("made by another model, backend, dtype or block size")
        if file_key != key:
            raise TierReadError("holds another block than its name says")
        return length


class _Writing:
    """A block whose file is being written: its bytes (served to reads meanwhile) and the write. A borrowed row is
    the lender's (its bytes there once ``ready`` completes) until the writer or the lender, whichever comes first,
    copies it (:meth:`give_back`)."""

    __slots__ = ("row", "ready", "borrowed", "write", "error", "_lock")

    def __init__(self, row: torch.Tensor, ready: torch.cuda.Event | None, borrowed: bool = True):
        self.row = row
        self.ready = ready
        self.borrowed = borrowed
        # Ends once the file is written (or its write failed, with the error kept).
        self.write: Future[None]
        self.error: OSError | None = None
        self._lock = threading.Lock()

    def give_back(self) -> bool:
        with self._lock:  # held by the other side at most for its copy
            if not self.borrowed:
                return False
            if self.ready is not None:
                self.ready.synchronize()  # the copy from the device into the lender's row
            self.row = clone_host_bytes(self.row)
            self.borrowed, self.ready = False, None
            return True


class _Batch:
    """One store's file operations for one writer thread, run in the order asked; ``done`` ends after the last."""

    __slots__ = ("ops", "done")

    def __init__(self) -> None:
        self.ops: list[Callable[[], None]] = []
        self.done: Future[None] = Future()

    def run(self) -> None:
        try:
            for op in self.ops:
                try:
                    op()
                except Exception:  # one block's surprise must not cost the others theirs
                    log.exception("a KV block file operation failed")
        finally:
            self.done.set_result(None)


def _remove_file(path: Path) -> None:
    try:
        path.unlink(missing_ok=True)
    except OSError as exc:  # a file left behind costs disk space, not correctness: a warm start checks each file
        log.warning("could not remove KV block file %s: %s", path, exc)
