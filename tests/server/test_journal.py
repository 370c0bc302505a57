"""The request journal on its own: framing, a torn tail and corrupt records after a crash, group commit, compaction."""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rtxcore.errors import ConfigError
from rtxcore.server.serving.durable.journal import Journal, JournalClosed, JournalOptions
from rtxcore.server.serving.durable.records import decode_records, encode_record
from rtxcore.server.serving.durable.replay import group_records


def record(req_id: str, kind: str = "out", **fields) -> dict:
    return {"t": kind, "id": req_id, **fields}


def open_journal(directory, **options) -> tuple[Journal, list[dict]]:
    journal = Journal(directory, JournalOptions(**options))
    return journal, journal.open()


def test_records_survive_a_reopen_in_order(tmp_path):
    journal, old = open_journal(tmp_path)
    assert old == []
    written = [record("a", "accept", prompts=[[1, 2]]), record("a", seq=1, ev='{"text":"\\n\u2028"}'),
               record("a", "finish", time=1.0, status=200, body=None)]
    for r in written:
        journal.append(r)
    journal.close()
    reopened, records = open_journal(tmp_path)
    assert records == written
    reopened.close()
    with pytest.raises(JournalClosed):
        reopened.append(record("b"))


def test_a_torn_last_record_is_ignored_with_a_log_line_and_cut_off(tmp_path, caplog):
    journal, _ = open_journal(tmp_path)
    journal.append(record("a", "accept"))
    journal.append(record("a", seq=1, ev="x"))
    journal.close()
    whole = encode_record(record("a", seq=2, ev="y" * 50))
    with open(journal.path, "ab") as f:
        f.write(whole[: len(whole) // 2])  # the process died in the middle of this write
    size_with_tear = journal.path.stat().st_size
    with caplog.at_level(logging.WARNING, logger="rtx.journal"):
        again, records = open_journal(tmp_path)
    assert [r.get("seq") for r in records] == [None, 1]
    assert "torn last record" in caplog.text
    # Cut off, so that the next record is not glued to the torn one.
    assert journal.path.stat().st_size < size_with_tear
    again.append(record("a", seq=2, ev="z"))
    again.close()
    _, records = open_journal(tmp_path)
    assert [r.get("seq") for r in records] == [None, 1, 2]
    assert decode_records(journal.path.read_bytes()).num_corrupt == 0


def test_a_corrupt_record_in_the_middle_is_skipped_and_counted(tmp_path, caplog):
    journal, _ = open_journal(tmp_path)
    for seq in range(1, 4):
        journal.append(record("a", seq=seq, ev=f"event {seq}"))
    journal.close()
    data = bytearray(journal.path.read_bytes())
    data[data.index(b"event 2")] ^= 0x01  # one flipped bit on disk: the checksum catches it
    journal.path.write_bytes(bytes(data))
    with caplog.at_level(logging.WARNING, logger="rtx.journal"):
        again, records = open_journal(tmp_path)
    assert [r["seq"] for r in records] == [1, 3]
    assert again.stats.num_corrupt_records == 1 and "corrupt record at byte" in caplog.text
    again.close()


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=400), st.integers(min_value=0, max_value=10_000))
def test_no_damage_makes_reading_raise(noise, position):
    good = b"".join(encode_record(record(f"r{i}", seq=i, ev="e" * i)) for i in range(5))
    cut = position % (len(good) + 1)
    result = decode_records(good[:cut] + noise + good[cut:])
    assert len(result.records) <= 5 + noise.count(b"\n") + 1
    assert all(isinstance(r, dict) and "id" in r and "t" in r for r in result.records)


def test_records_without_an_accept_are_dropped_when_grouped(caplog):
    records = [record("a", "accept"), record("a", seq=1, ev="x", o={"c": 0, "tok": [5]}), record("b", seq=1, ev="y"),
               record("a", "finish", time=1.0, status=200, body=None)]
    with caplog.at_level(logging.WARNING, logger="rtx.journal"):
        grouped = group_records(records)
    assert [g.req_id for g in grouped] == ["a"]
    assert grouped[0].events == ["x"] and grouped[0].outputs == [{"c": 0, "tok": [5]}]
    assert grouped[0].finish is not None and "request b has no accept record" in caplog.text


def test_commit_returns_only_after_an_fsync_covers_the_record_and_concurrent_commits_share_one(tmp_path,
                                                                                               monkeypatch):
    journal, _ = open_journal(tmp_path, sync_interval_s=60)  # no periodic sync: only commits fsync
    real_fsync = os.fsync
    synced_sizes: list[int] = []

    def slow_fsync(fd: int) -> None:
        time.sleep(0.05)  # a disk that takes a while, so that commits pile up behind one fsync
        real_fsync(fd)
        synced_sizes.append(os.fstat(fd).st_size)

    monkeypatch.setattr(os, "fsync", slow_fsync)
    ends: list[tuple[int, int]] = []

    def accept(i: int) -> None:
        end = journal.append(record(f"r{i}", "accept"))
        journal.commit_future().result(10)
        # When the commit returns, an fsync has covered this record.
        ends.append((end, max(synced_sizes)))

    threads = [threading.Thread(target=accept, args=(i,)) for i in range(20)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(ends) == 20 and all(synced >= end for end, synced in ends)
    assert journal.stats.num_fsyncs < 20, "concurrent commits must share fsyncs (group commit)"
    monkeypatch.setattr(os, "fsync", real_fsync)
    journal.close()


def test_commit_from_asyncio(tmp_path):
    journal, _ = open_journal(tmp_path, sync_interval_s=60)

    async def main() -> int:
        end = journal.append(record("a", "accept"))
        assert journal.synced_offset < end
        await journal.commit()
        return end

    end = asyncio.run(main())
    assert journal.synced_offset >= end
    journal.close()


def test_output_records_are_synced_periodically_without_a_commit(tmp_path):
    journal, _ = open_journal(tmp_path, sync_interval_s=0.05)
    end = journal.append(record("a", seq=1, ev="x"))
    deadline = time.monotonic() + 5
    while journal.synced_offset < end and time.monotonic() < deadline:
        time.sleep(0.01)
    assert journal.synced_offset >= end
    journal.close()


def test_compaction_keeps_unfinished_and_retained_requests_only(tmp_path):
    journal, _ = open_journal(tmp_path, retention_s=100)
    now = time.time()
    for req_id, finished_at in (("running", None), ("recent", now - 10), ("old", now - 1000)):
        journal.append(record(req_id, "accept"))
        journal.append(record(req_id, seq=1, ev="x" * 100))
        if finished_at is not None:
            journal.append(record(req_id, "finish", time=finished_at, status=200, body=None))
    assert journal.expired() == {"old"}
    journal.compact()
    journal.append(record("running", seq=2, ev="after compaction"))
    journal.close()
    assert not list(tmp_path.glob("*.tmp"))
    _, records = open_journal(tmp_path)
    assert {r["id"] for r in records} == {"running", "recent"}
    assert [r.get("ev") for r in records if r["id"] == "running"] == [None, "x" * 100, "after compaction"]


def test_compaction_triggers_on_size_and_garbage(tmp_path):
    journal, _ = open_journal(tmp_path, retention_s=0, sync_interval_s=0.02, compact_min_bytes=2000,
                              compact_garbage_ratio=0.5)
    for i in range(20):
        journal.append(record(f"r{i}", "accept", pad="p" * 100))
        journal.append(record(f"r{i}", "finish", time=time.time() - 1, status=200, body=None))
    journal.append(record("live", "accept"))
    deadline = time.monotonic() + 5
    while journal.stats.num_compactions == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert journal.stats.num_compactions >= 1
    journal.close()
    assert [r["id"] for r in decode_records(journal.path.read_bytes()).records] == ["live"]


def test_options_are_validated():
    with pytest.raises(ConfigError, match="retention"):
        JournalOptions(retention_s=-1)
    with pytest.raises(ConfigError, match="garbage"):
        JournalOptions(compact_garbage_ratio=0)


def test_a_failed_write_is_cut_back_and_records_wait_until_the_disk_takes_them(tmp_path, monkeypatch):
    # The disk full (ENOSPC) after part of a record went out: the part is cut off, accepts are refused, outputs wait
    # in memory, in order, and reach the file once writes succeed again. (The real disk filling up is the disk-full
    # chaos drill, tests/chaos.)
    import errno

    from rtxcore.server.serving.durable import journal as journal_module

    journal, _ = open_journal(tmp_path, sync_interval_s=0.05)
    journal.append(record("a", "accept", prompts=[[1]]))
    real_write_all = journal_module.write_all
    full = threading.Event()
    full.set()

    def write_all(fd, data):
        if full.is_set():
            os.write(fd, data[: len(data) // 2])
            raise OSError(errno.ENOSPC, "No space left on device")
        real_write_all(fd, data)

    monkeypatch.setattr(journal_module, "write_all", write_all)
    journal.append(record("a", seq=1, ev="one"))
    journal.append(record("a", seq=2, ev="two"))
    assert journal.degraded
    with pytest.raises(OSError, match="No space left"):
        journal.append_many([record("b", "accept", prompts=[[2]])], must_write=True)
    assert decode_records(journal.path.read_bytes()).records == [record("a", "accept", prompts=[[1]])]
    full.clear()
    deadline = time.monotonic() + 10
    while journal.degraded and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not journal.degraded
    journal.append(record("a", "finish", time=1.0, body=None))
    journal.close()
    assert [r.get("ev", r["t"]) for r in decode_records(journal.path.read_bytes()).records] == [
        "accept", "one", "two", "finish"]
