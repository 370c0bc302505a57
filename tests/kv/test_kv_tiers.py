"""KV tiers: host memory and disk under the device's prefix cache, checked with real tensors and real files."""

from __future__ import annotations

import random
import threading

import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

import rtxcore.kv.tiers.disk as disk_tier_module
from rtxcore.kv.manager import KVCacheManager
from rtxcore.kv.tiers.base import KVTier, TierReadError
from rtxcore.kv.tiers.disk import DiskTier
from rtxcore.kv.tiers.host import HostTier
from rtxcore.kv.tiers.offload import KVOffload
from tests.helpers.kv import POLICIES
from tests.kv.test_kv_manager_properties import WorkloadMachine

FINGERPRINT = bytes(20)
BLOCK_BYTES = 32


def key(n: int) -> bytes:
    return n.to_bytes(16, "little")


def payload(n: int) -> torch.Tensor:
    """A block's bytes that name its key, so any mix-up between blocks shows."""
    return torch.full((BLOCK_BYTES,), n % 251, dtype=torch.uint8)


def tier_chain(tmp_path, host_slots: int, disk_slots: int, policy: str = "lru") -> tuple[HostTier, DiskTier]:
    disk = DiskTier(tmp_path, disk_slots, BLOCK_BYTES, POLICIES[policy](disk_slots), FINGERPRINT)
    host = HostTier(host_slots, BLOCK_BYTES, POLICIES[policy](host_slots), below=disk)
    return host, disk


def held_disk_writes(monkeypatch) -> threading.Event:
    """Block files are written only once the returned gate is set (a slow disk, or a writer behind)."""
    gate = threading.Event()
    write_file = disk_tier_module.replace_atomically

    def held(path, data, durable=True):
        assert gate.wait(30), "the test never opened the gate"
        write_file(path, data, durable)

    monkeypatch.setattr(disk_tier_module, "replace_atomically", held)
    return gate


def test_blocks_go_through_to_disk_as_they_arrive_and_read_back_intact(tmp_path):
    host, disk = tier_chain(tmp_path, 2, 8)
    for n in range(5):
        host.store([key(n)], payload(n).unsqueeze(0))
    # Host keeps the two newest; every block went on to disk as it arrived, so evicting the three older moved nothing.
    assert set(host.keys()) == {key(3), key(4)}
    assert set(disk.keys()) == {key(n) for n in range(5)} and disk.stats.num_stored == 5
    disk.flush()
    assert all(disk.path(key(n)).exists() for n in range(5))
    for n in range(5):
        for tier in (host, disk) if key(n) in host else (disk,):
            assert tier.pin(key(n))
            assert torch.equal(tier.load(key(n)), payload(n))
            tier.unpin(key(n))
    host.check_invariants(), disk.check_invariants()


def writers_held() -> threading.Event:
    """Every disk writer thread waits at the returned gate before the operations queued after this call."""
    gate = threading.Event()
    for writer in range(disk_tier_module.WRITE_THREADS):
        disk_tier_module._queue_file_op(writer, gate.wait, 30)
    return gate


def test_a_lent_slot_is_written_again_only_once_its_bytes_are_copied(tmp_path):
    """The host lends its rows to the disk tier's writer: a slot reused before the writer reached its block is copied
    on the engine's thread first (counted), one the writer has copied is reused as it is; either way the file holds
    the block the slot held when it was lent."""
    host, disk = tier_chain(tmp_path, 1, 8)
    gate = writers_held()
    try:
        host.store([key(1)], payload(1).unsqueeze(0))
        host.store([key(2)], payload(2).unsqueeze(0))  # slot 0 again, while key 1's write waits in its queue
        assert host.stats.num_lent_copies == 1
        assert disk.pin(key(1)) and torch.equal(disk.load(key(1)), payload(1))
        disk.unpin(key(1))
    finally:
        gate.set()
    disk.flush()  # key 2's write has copied its row by now
    host.store([key(3)], payload(3).unsqueeze(0))
    assert host.stats.num_lent_copies == 1
    disk.flush()
    for n in (1, 2, 3):
        assert disk.path(key(n)).exists()
        assert disk.pin(key(n)) and torch.equal(disk.reader(key(n), False)(), payload(n))
        disk.unpin(key(n))
    host.check_invariants(), disk.check_invariants()


def test_storing_a_held_key_is_a_touch_not_a_copy(tmp_path):
    host, _ = tier_chain(tmp_path, 2, 2)
    host.store([key(1), key(2)], torch.stack([payload(1), payload(2)]))
    host.store([key(1)], payload(1).unsqueeze(0))  # touched: now the most recent
    host.store([key(3)], payload(3).unsqueeze(0))
    assert host.stats.num_stored == 3 and set(host.keys()) == {key(1), key(3)}


def test_a_damaged_block_file_is_dropped_never_loaded(tmp_path, caplog):
    _, disk = tier_chain(tmp_path, 1, 2)
    disk.store([key(7)], payload(7).unsqueeze(0))
    disk.flush()  # written on the tier's own thread
    path = disk.path(key(7))
    raw = bytearray(path.read_bytes())
    raw[-1] ^= 0xFF
    path.write_bytes(bytes(raw))
    assert disk.pin(key(7))
    with pytest.raises(TierReadError, match="checksum"):
        disk.load(key(7))
    disk.unpin(key(7))  # a no-op now: the block left with its pin
    disk.flush()  # its file is removed on the tier's own thread
    assert key(7) not in disk and not path.exists() and disk.stats.num_corrupt == 1
    disk.check_invariants()


def test_a_block_file_of_another_cache_is_not_adopted(tmp_path):
    _, disk = tier_chain(tmp_path, 1, 2)
    disk.store([key(1)], payload(1).unsqueeze(0))
    disk.flush()
    other = DiskTier(tmp_path, 2, BLOCK_BYTES, POLICIES["lru"](2), b"\x01" * 20)
    assert not other.adopt(key(1)) and not disk.path(key(1)).exists()


# ---- hypothesis: tiers alone --------------------------------------------------------------------------------------

class TierMachine(RuleBasedStateMachine):
    """Stores, pins, loads and unpins on a host tier over a disk tier with room for few blocks.

    Properties: each key sits in at most one slot of a tier; a tier never holds more than its slots; a pinned key
    never moves (same slot, still there) whatever is stored meanwhile; every key ever stored is still in a tier
    unless the disk tier (the bottom) evicted or refused something; what comes back is what went in.
    """

    def __init__(self):
        super().__init__()
        import tempfile

        self.dir = tempfile.TemporaryDirectory()
        from pathlib import Path

        self.host, self.disk = tier_chain(Path(self.dir.name), 3, 4, random.choice(list(POLICIES)))
        self.stored: set[bytes] = set()
        self.pinned: dict[bytes, tuple[KVTier, int]] = {}

    @rule(ns=st.lists(st.integers(0, 15), min_size=1, max_size=4, unique=True))
    def store(self, ns):
        self.host.store([key(n) for n in ns], torch.stack([payload(n) for n in ns]))
        self.stored.update(key(n) for n in ns)

    @rule(n=st.integers(0, 15))
    def pin(self, n):
        k = key(n)
        for tier in (self.host, self.disk):
            if k not in self.pinned and tier.pin(k):
                self.pinned[k] = (tier, tier._slot_of[k])
                return

    @precondition(lambda self: self.pinned)
    @rule(pick=st.integers(0, 15), load=st.booleans())
    def unpin(self, pick, load):
        k = sorted(self.pinned)[pick % len(self.pinned)]
        tier, _ = self.pinned.pop(k)
        if load:
            assert torch.equal(tier.load(k), payload(int.from_bytes(k, "little")))
        tier.unpin(k)

    @invariant()
    def consistent(self):
        for tier in (self.host, self.disk):
            tier.check_invariants()
            assert len(tier) <= tier.num_slots
        for k, (tier, slot) in self.pinned.items():
            assert tier._slot_of.get(k) == slot, "a pinned block moved"
        held = set(self.host.keys()) | set(self.disk.keys())
        drops = self.disk.stats.num_evicted + self.host.stats.num_rejected + self.disk.stats.num_rejected
        assert len(self.stored - held) <= drops, "a block left every tier without the bottom tier dropping it"
        if drops == 0:
            assert self.stored <= held

    def teardown(self):
        self.disk.flush()  # its files are written on the tier's own thread
        self.dir.cleanup()


TestTierMachine = TierMachine.TestCase
TestTierMachine.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)


# ---- hypothesis: the KV-cache manager over the tiers --------------------------------------------------------------

class TieredWorkloadMachine(WorkloadMachine):
    """The manager's random workload (prefix hits checked against what was "computed" into each block) with a host
    and a disk tier under a small device pool: blocks leave the device, come back, and must hold the same tokens.
    The test plays the backend's KV copies too, encoding each block's recorded tokens and salt as its bytes."""

    num_blocks = 8
    # Copy computed blocks down ahead of their eviction (tests/kv/test_write_back.py runs this machine with it).
    write_back = False
    # Evict blocks in batches ahead of the allocations (tests/kv/test_evict_ahead.py runs this machine with it).
    evict_ahead = False

    def __init__(self):
        super().__init__()
        import tempfile
        from pathlib import Path

        self.dir = tempfile.TemporaryDirectory()
        self.width = self.block_size + 1
        nbytes = 4 * self.width
        disk = DiskTier(Path(self.dir.name), 6, nbytes, POLICIES[self.policy_name](6), FINGERPRINT)
        host = HostTier(3, nbytes, POLICIES[self.policy_name](3))
        self.offload = KVOffload([host, disk], self._read_blocks, self._write_blocks)
        kv = KVCacheManager(self.num_blocks, self.block_size, POLICIES[self.policy_name](self.num_blocks),
                            offload=self.offload, write_back=self.write_back, evict_ahead=self.evict_ahead)
        self.kv = kv
        self.spilled: set[bytes] = set()
        spill = kv.pool.on_evict  # the manager's, which also tells the write-back
        assert spill is not None
        kv.pool.on_evict = lambda victims: (self.spilled.update(k for _, k in victims), spill(victims))

    def _read_blocks(self, block_ids):
        rows = [[-1 if t is None else t for t in self.content[b]] + [1 if self.salt_of[b] == "s" else -1]
                for b in block_ids]
        return torch.tensor(rows, dtype=torch.int32).view(torch.uint8)

    def _write_blocks(self, block_ids, data):
        for block_id, row in zip(block_ids, data.view(torch.int32).reshape(len(block_ids), self.width).tolist()):
            self.content[block_id] = [None if t == -1 else t for t in row[:-1]]
            self.salt_of[block_id] = "s" if row[-1] == 1 else None

    @invariant()
    def tiers_consistent(self):
        host, disk = self.offload.tiers
        for tier in (host, disk):
            tier.check_invariants()
            assert len(tier) <= tier.num_slots
        device = {k for _, k in self.kv.cached_blocks()}
        held = device | set(host.keys()) | set(disk.keys())
        drops = disk.stats.num_evicted + host.stats.num_rejected + disk.stats.num_rejected
        assert len(self.spilled - held) <= drops, "an evicted block was lost without the bottom tier dropping it"

    @rule()
    def reset_prefix_cache(self):
        super().reset_prefix_cache()
        self.spilled.clear()
        assert all(len(t) == 0 for t in self.offload.tiers)

    def teardown(self):
        super().teardown()
        self.offload.tiers[-1].flush()  # the disk tier's files are written on its own thread
        self.dir.cleanup()


class ARCTieredWorkloadMachine(TieredWorkloadMachine):
    policy_name = "arc"


_settings = settings(max_examples=30, stateful_step_count=40, deadline=None)
TestTieredWorkloadLRU = TieredWorkloadMachine.TestCase
TestTieredWorkloadLRU.settings = _settings
TestTieredWorkloadARC = ARCTieredWorkloadMachine.TestCase
TestTieredWorkloadARC.settings = _settings


@pytest.mark.parametrize("seed", range(4))
def test_long_tiered_workload_reloads(seed):
    """Sustained pressure: blocks must actually come back from the tiers, with the right tokens (checked on every
    admission by the workload machine)."""
    rng = random.Random(seed)
    m = TieredWorkloadMachine()
    for _ in range(300):
        op = rng.choices(["add", "admit", "step", "abort"], [3, 4, 8, 1])[0]
        if op == "add":
            m.add_request(rng.randrange(3), [rng.randrange(4) for _ in range(rng.randrange(7))], None,
                          rng.randint(1, 8))
        elif op == "admit" and m.waiting:
            m.admit(rng.randrange(8), rng.randint(1, 12))
        elif op == "step" and m.running:
            m.step(rng.randrange(8), rng.randint(1, 12))
        elif op == "abort" and (m.running or m.waiting):
            m.abort(rng.randrange(8))
        m.consistent()
        m.tiers_consistent()
    assert m.kv.stats.num_reloaded_tokens > 0
    m.teardown()


def test_a_full_disk_costs_blocks_not_the_tier(tmp_path, monkeypatch):
    import errno

    host, disk = tier_chain(tmp_path, 1, 4)

    def no_space(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(disk_tier_module, "replace_atomically", no_space)
    host.store([key(1)], payload(1).unsqueeze(0))  # written through: the disk cannot take it
    disk.flush()  # the write fails on the tier's own thread; the block leaves once that is seen
    assert key(1) in host and key(1) not in disk and disk.stats.num_rejected == 1 and len(disk) == 0
    monkeypatch.undo()
    host.store([key(2)], payload(2).unsqueeze(0))  # key 1 evicted from host, and the disk takes it now
    disk.flush()
    assert all(key(n) in disk and disk.path(key(n)).exists() for n in (1, 2))
    assert disk.pin(key(1)) and torch.equal(disk.load(key(1)), payload(1))
    disk.unpin(key(1))
    host.check_invariants(), disk.check_invariants()


def test_a_spill_to_disk_never_waits_for_the_file(tmp_path, monkeypatch):
    """The file is written on the tier's own thread: a store returns while the write is held, reads meanwhile get
    the stored bytes, and a block removed before its write ran leaves no file behind."""
    gate = held_disk_writes(monkeypatch)
    host, disk = tier_chain(tmp_path, 1, 2)
    host.store([key(1)], payload(1).unsqueeze(0))  # written through: the call returned, the write is held
    host.store([key(2)], payload(2).unsqueeze(0))  # key 1 leaves the host, its slot takes key 2: no wait either
    assert key(1) in disk and not disk.path(key(1)).exists()
    assert disk.pin(key(1))
    assert torch.equal(disk.load(key(1)), payload(1))
    assert torch.equal(disk.reader(key(1), False)(), payload(1))
    disk.unpin(key(1))
    host.store([key(3)], payload(3).unsqueeze(0))  # the disk's room is two: key 1 (never written yet) leaves it
    gate.set()
    disk.flush()
    assert key(1) not in disk and not disk.path(key(1)).exists() and disk.path(key(2)).exists()
    assert disk.pin(key(2)) and torch.equal(disk.load(key(2)), payload(2))
    disk.unpin(key(2))
    host.check_invariants(), disk.check_invariants()


def test_a_disk_slower_than_the_spills_costs_blocks_never_a_wait(tmp_path, monkeypatch):
    """Past the write backlog a spill leaves blocks out instead of waiting for the writer (which would hold every
    running request's step), and counts them; a snapshot's copies (storing_all) wait for the writer instead, so a
    snapshot holds every block it is given."""
    gate = held_disk_writes(monkeypatch)
    monkeypatch.setattr(disk_tier_module, "WRITE_BACKLOG_BYTES", 2 * BLOCK_BYTES)
    _, disk = tier_chain(tmp_path, 1, 8)
    disk.store([key(n) for n in range(4)], torch.stack([payload(n) for n in range(4)]))  # returns: nothing waited
    assert [key(n) in disk for n in range(4)] == [True, True, False, False]
    assert disk.stats.num_skipped_busy == 2 and disk.stats.num_stored == 2

    threading.Timer(0.2, gate.set).start()  # the writer catches up only later: storing_all must wait for it
    with disk.storing_all():
        disk.store([key(n) for n in range(4, 8)], torch.stack([payload(n) for n in range(4, 8)]))
    assert all(key(n) in disk for n in range(4, 8)) and disk.stats.num_skipped_busy == 2
    disk.flush()
    for n in (0, 1, 4, 5, 6, 7):
        assert disk.pin(key(n)) and torch.equal(disk.load(key(n)), payload(n))
        disk.unpin(key(n))
    disk.check_invariants()
