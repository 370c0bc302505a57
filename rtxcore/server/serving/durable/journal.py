"""The request journal: an append-only file of records under ``<state_dir>/journal/``, with group commit.

Writes are plain ``os.write`` calls, in the order the server makes them: a record is in the kernel's page cache
(which a ``kill -9`` does not lose) before the event it describes is sent. Durability against a power loss comes
from ``fsync``, done by one flusher thread:

- :meth:`Journal.commit` waits until an ``fsync`` covers everything written so far. Requests accepted together share
  one ``fsync`` (group commit): whoever arrives while one runs is covered by the next.
- Everything else (output events) is synced every ``sync_interval_s`` by the same thread, not per token.

Compaction rewrites the file (temporary file, ``fsync``, ``rename``, ``fsync`` of the directory) keeping only the
records of requests that are unfinished or finished within ``retention_s``, once the file is over
``compact_min_bytes`` and most of it is garbage.

A write that fails (the disk full, or failing) is undone (the file cut back to its last whole record) and the journal
is *degraded*: records of requests already accepted wait in memory, in order, up to :data:`MAX_BACKLOG_BYTES`, and
the flusher writes them once the disk takes them again; meanwhile an accept record is refused
(:meth:`Journal.append_many` with ``must_write``), so the server turns new requests away (503) instead of
acknowledging what it could not make durable. Running requests go on; until the backlog is written, a ``kill -9``
would lose what waits in it (those requests then resume from their last record that was written).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rtxcore.errors import ConfigError
from rtxcore.files import replace_atomically, write_all
from rtxcore.server.serving.durable.records import decode_records, encode_record

log = logging.getLogger("rtx.journal")

JOURNAL_FILE = "journal.log"
# After a failed fsync: wait this long before trying again, rather than spin (and flood the log).
_RETRY_AFTER_FAILURE_S = 0.5
# Records of accepted requests kept in memory while the disk refuses writes; past it, their requests fail.
MAX_BACKLOG_BYTES = 64 << 20


class JournalClosed(RuntimeError):
    """An append after :meth:`Journal.close` (the server is stopping): what it would record must not be sent."""


@dataclass(slots=True)
class JournalOptions:
    # Finished requests stay replayable (and in the journal) this long.
    retention_s: float = 600.0
    # How often output events written since the last fsync are synced.
    sync_interval_s: float = 0.2
    # Compaction runs once the file is at least this large and ...
    compact_min_bytes: int = 4 << 20
    # ... at least this share of its bytes belongs to requests past retention.
    compact_garbage_ratio: float = 0.5

    def __post_init__(self) -> None:
        if self.retention_s < 0:
            raise ConfigError(f"journal retention must be >= 0 seconds, got {self.retention_s}")
        if self.sync_interval_s <= 0:
            raise ConfigError(f"journal sync interval must be > 0 seconds, got {self.sync_interval_s}")
        if self.compact_min_bytes < 1:  # an empty journal would be "all garbage" and rewritten on every sync
            raise ConfigError(f"compact_min_bytes must be at least 1, got {self.compact_min_bytes}")
        if not 0 < self.compact_garbage_ratio <= 1:
            raise ConfigError(f"compact_garbage_ratio must be in (0, 1], got {self.compact_garbage_ratio}")


@dataclass(slots=True)
class JournalStats:
    """Counters for metrics (read without the lock: each is a plain int written by one thread)."""

    num_records: int = 0
    num_fsyncs: int = 0
    num_compactions: int = 0
    num_corrupt_records: int = 0


class Journal:
    def __init__(self, directory: str | Path, options: JournalOptions | None = None):
        self.directory = Path(directory)
        self.options = options or JournalOptions()
        self.path = self.directory / JOURNAL_FILE
        self.stats = JournalStats()
        self._fd = -1
        self._write_lock = threading.Lock()
        # Bytes written / covered by an fsync: a commit waits until synced reaches what was written when it asked.
        self._written = 0
        self._synced = 0
        # Bumped when compaction swaps the file: an fsync of the old file then covers nothing of the new one.
        self._generation = 0
        self._cond = threading.Condition()
        self._waiters: list[tuple[int, concurrent.futures.Future]] = []
        # Bytes of each request's records, and when each finished request did (time.time()), for compaction.
        self._bytes: dict[str, int] = {}
        self._finished_at: dict[str, float] = {}
        self._closing = False
        # Records a failed write left to write later, in order (guarded by the write lock), and the failure.
        self._backlog: list[bytes] = []
        self._backlog_bytes = 0
        self._backlog_error: OSError | None = None
        self._backlog_since = 0.0
        self._thread = threading.Thread(target=self._flush_loop, name="rtx-journal", daemon=True)

    # -- lifecycle ------------------------------------------------------------------------------------------------

    def open(self) -> list[dict[str, Any]]:
        """Read what a previous run left (damaged lines logged and skipped, a torn tail cut off), then start the
        flusher; returns the intact records in file order."""
        self.directory.mkdir(parents=True, exist_ok=True)
        for stale in self.directory.glob(f"{JOURNAL_FILE}.tmp*"):
            # A compaction a crash interrupted before its rename: the journal itself is whole, this is not.
            stale.unlink(missing_ok=True)
        try:
            data = self.path.read_bytes()
        except FileNotFoundError:
            data = b""
        result = decode_records(data, str(self.path))
        self.stats.num_corrupt_records = result.num_corrupt
        self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        if result.valid_end < len(data):
            # Appending after a torn line would glue the next record to it.
            os.ftruncate(self._fd, result.valid_end)
            os.fsync(self._fd)
        self._written = self._synced = result.valid_end
        for record in result.records:
            self._account(record, len(encode_record(record)))
        self._thread.start()
        return result.records

    def close(self) -> None:
        """Sync what was written and close; appends after this are refused."""
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        if self._thread.is_alive():
            self._thread.join(10)
        with self._write_lock:
            if self._fd >= 0:
                os.fsync(self._fd)
                os.close(self._fd)
                self._fd = -1

    # -- writing --------------------------------------------------------------------------------------------------

    def append(self, record: dict[str, Any]) -> int:
        """Write one record (no fsync); returns the file offset just past it."""
        return self.append_many([record])

    def append_many(self, records: list[dict[str, Any]], must_write: bool = False) -> int:
        """Write records with one ``write``: a process killed at any moment leaves all of them or none (a power
        loss may still tear the tail, which reading detects). Returns the offset just past them.

        While the disk refuses writes they join the backlog instead, unless ``must_write`` (an accept record).

        :raises OSError: the write failed and ``must_write``, or the backlog is full.
        :raises JournalClosed: the journal is closed.
        """
        lines = [encode_record(r) for r in records]
        data = b"".join(lines)
        with self._write_lock:
            if self._fd < 0:
                raise JournalClosed(f"the journal {self.path} is closed")
            if self._backlog_error is None:
                try:
                    self._write(data)
                except OSError as exc:
                    if must_write:
                        raise
                    self._backlog_error, self._backlog_since = exc, time.monotonic()
                    log.error("journal %s cannot be written (%s): new requests are refused until it can; the "
                              "records of running requests wait in memory", self.path, exc.strerror or exc)
            if self._backlog_error is not None:
                if must_write:
                    raise self._backlog_error
                if self._backlog_bytes + len(data) > MAX_BACKLOG_BYTES:
                    raise OSError(self._backlog_error.errno, f"journal backlog full ({MAX_BACKLOG_BYTES} bytes) "
                                  f"while the disk refuses writes: {self._backlog_error.strerror}")
                self._backlog.append(data)
                self._backlog_bytes += len(data)
            end = self._written + self._backlog_bytes
        for record, line in zip(records, lines):
            self._account(record, len(line))
        self.stats.num_records += len(records)
        return end

    def _write(self, data: bytes) -> None:
        """Append ``data`` whole or not at all (a failed write is cut back off); the write lock is held."""
        try:
            write_all(self._fd, data)
        except OSError:
            try:
                os.ftruncate(self._fd, self._written)  # a record half written would glue the next one to it
            except OSError:
                log.exception("journal %s: could not cut back a failed write", self.path)
            raise
        self._written += len(data)

    @property
    def degraded(self) -> bool:
        """Whether writes are failing (records wait in the backlog): the server then accepts no new request."""
        return self._backlog_error is not None

    def _write_backlog(self) -> None:
        """Write what waits in the backlog, in order, as far as the disk takes it (the flusher thread)."""
        with self._write_lock:
            if self._backlog_error is None or self._fd < 0:
                return
            while self._backlog:
                try:
                    self._write(self._backlog[0])
                except OSError:
                    return  # still refused: the next turn tries again
                self._backlog_bytes -= len(self._backlog.pop(0))
            log.warning("journal %s writable again after %.1f s", self.path, time.monotonic() - self._backlog_since)
            self._backlog_error = None

    def commit_future(self) -> concurrent.futures.Future:
        """A future done once an fsync covers every byte written before this call."""
        done: concurrent.futures.Future = concurrent.futures.Future()
        with self._cond:
            target = self._written
            if self._synced >= target:
                done.set_result(None)
            else:
                self._waiters.append((target, done))
                self._cond.notify_all()
        return done

    async def commit(self) -> None:
        await asyncio.wrap_future(self.commit_future())

    @property
    def synced_offset(self) -> int:
        return self._synced

    # -- the flusher thread ---------------------------------------------------------------------------------------

    def _flush_loop(self) -> None:
        next_check = time.monotonic() + self.options.sync_interval_s
        while True:
            with self._cond:
                if not self._waiters and not self._closing:
                    self._cond.wait(max(0.0, next_check - time.monotonic()))
                closing = self._closing
            try:
                self._write_backlog()
                self._sync()
                if time.monotonic() >= next_check:
                    next_check = time.monotonic() + self.options.sync_interval_s
                    self._maybe_compact()
            except Exception as exc:  # the flusher must outlive any failure, or every later commit would hang
                log.exception("journal %s: sync failed", self.path)
                self._fail_waiters(exc)
                if not closing:
                    time.sleep(_RETRY_AFTER_FAILURE_S)
            if closing:
                return

    def _sync(self) -> None:
        with self._write_lock:
            target, fd = self._written, self._fd
            if target <= self._synced or fd < 0:
                self._release_waiters(self._synced)
                return
            # fsync a duplicate outside the lock: appends (from the event loop) must not wait for the disk. The
            # generation tells whether compaction swapped the file meanwhile (it then settles the waiters itself).
            generation, fd = self._generation, os.dup(fd)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        self.stats.num_fsyncs += 1
        with self._write_lock:
            if generation == self._generation:
                self._release_waiters(target)

    def _release_waiters(self, synced: int) -> None:
        with self._cond:
            self._synced = max(self._synced, synced)
            ready = [f for t, f in self._waiters if t <= self._synced]
            self._waiters = [(t, f) for t, f in self._waiters if t > self._synced]
        for future in ready:
            _settle(future)

    def _fail_waiters(self, exc: BaseException) -> None:
        """Fail every waiting commit: their requests are answered with an error rather than left hanging."""
        with self._cond:
            ready, self._waiters = self._waiters, []
        for _, future in ready:
            _settle(future, exc)

    # -- compaction -----------------------------------------------------------------------------------------------

    def _account(self, record: dict[str, Any], size: int) -> None:
        req_id = record["id"]
        self._bytes[req_id] = self._bytes.get(req_id, 0) + size
        if record["t"] == "finish":
            self._finished_at[req_id] = float(record.get("time", time.time()))

    def expired(self, now: float | None = None) -> set[str]:
        """Requests finished longer ago than the retention window."""
        cutoff = (time.time() if now is None else now) - self.options.retention_s
        return {req_id for req_id, at in list(self._finished_at.items()) if at < cutoff}

    def _maybe_compact(self) -> None:
        size = self._written
        if size < self.options.compact_min_bytes or self._backlog_error is not None:
            return
        expired = self.expired()
        garbage = sum(self._bytes.get(req_id, 0) for req_id in expired)
        if garbage < self.options.compact_garbage_ratio * size:
            return
        self.compact()

    def compact(self) -> None:
        """Rewrite the file without the requests past retention; crash-safe (the old file stays whole until the
        rename)."""
        with self._write_lock:
            if self._fd < 0:
                return
            expired = self.expired()
            result = decode_records(self.path.read_bytes(), str(self.path))
            kept = b"".join(encode_record(r) for r in result.records if r["id"] not in expired)
            replace_atomically(self.path, kept)
            old_fd, self._fd = self._fd, -1  # never left naming a closed descriptor if the reopen fails
            os.close(old_fd)
            self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND)
            self._generation += 1
            self._written = len(kept)
            # Everything written so far is in the new file and synced: every waiting commit is satisfied (their
            # offsets were of the old file).
            with self._cond:
                self._synced = len(kept)
                ready, self._waiters = self._waiters, []
            for _, future in ready:
                _settle(future)
            for req_id in expired:
                self._bytes.pop(req_id, None)
                self._finished_at.pop(req_id, None)
        self.stats.num_compactions += 1
        log.info("journal %s compacted: %d requests past retention dropped, %d bytes kept", self.path,
                 len(expired), len(kept))


def _settle(future: concurrent.futures.Future, exc: BaseException | None = None) -> None:
    """Resolve a commit's future unless its waiter gave up (a cancelled future refuses a result)."""
    try:
        if exc is None:
            future.set_result(None)
        else:
            future.set_exception(exc)
    except concurrent.futures.InvalidStateError:
        pass
