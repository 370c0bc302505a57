"""Blocks only the disk tier holds are read on worker threads, never on the engine's thread: the request that needs
them waits outside the steps (keeping its place) while others run, and joins with them once they are in; a damaged
file ends the hit there; a request that leaves first leaves them in the tier above; two requests with one prefix
read it once. Real block files; a disk tier whose reads wait for the test stands in for a slow disk."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence

import pytest
import torch

from rtxcore.kv.hashing import hash_blocks
from rtxcore.kv.manager import COPY_POLL_S, KVCacheManager
from rtxcore.kv.tiers.base import KVTier
from rtxcore.kv.tiers.disk import DiskTier
from rtxcore.kv.tiers.host import HostTier
from rtxcore.kv.tiers.offload import KVOffload
from rtxcore.request import Request, RequestStatus
from tests.helpers.kv import POLICIES, make_request
from tests.kv.test_reload_overlap import BLOCK_SIZE, NUM_BLOCKS, WIDTH, computed, first_turn_pushed_out, make_scheduler

HISTORY = [5] * 12  # 3 full blocks


class GatedDisk(DiskTier):
    """A disk tier whose block reads wait for ``gate`` (as reads of a slow disk still in flight), counted."""

    def __init__(self, root):
        super().__init__(root, 32, WIDTH, POLICIES["lru"](32), bytes(20))
        self.gate = threading.Event()
        self.num_reads = 0
        self.reader_threads: set[str] = set()

    def reader(self, key, pin_memory) -> Callable[[], torch.Tensor]:
        self.num_reads += 1
        read = super().reader(key, pin_memory)

        def gated() -> torch.Tensor:
            self.reader_threads.add(threading.current_thread().name)
            if not self.gate.wait(60):
                raise TimeoutError("the test never opened the gate")
            return read()
        return gated


def tiers(tmp_path, host_slots: int) -> tuple[KVCacheManager, KVOffload, GatedDisk, torch.Tensor]:
    cache = torch.zeros(NUM_BLOCKS, WIDTH, dtype=torch.uint8)

    def write(ids, data):
        cache[ids] = data

    disk = GatedDisk(tmp_path)
    stack: list[KVTier] = [disk]
    if host_slots:
        stack.insert(0, HostTier(host_slots, WIDTH, POLICIES["lru"](host_slots), below=disk))
    offload = KVOffload(stack, lambda ids: cache[ids].clone(), write)
    return KVCacheManager(NUM_BLOCKS, BLOCK_SIZE, POLICIES["lru"](NUM_BLOCKS), True, offload), offload, disk, cache


def history_keys() -> list[bytes]:
    return hash_blocks(HISTORY, BLOCK_SIZE, None, None)


def wait_ready(kv: KVCacheManager, req: Request) -> None:
    """What a scheduler does at every step: ask, until the reads are in."""
    deadline = time.monotonic() + 30
    while not kv.ready(req):
        assert time.monotonic() < deadline, "the disk reads never came in"
        time.sleep(0.002)


def steps_until(kv: KVCacheManager, condition: Callable[[], bool], what: str, reqs: Sequence[Request] = ()) -> None:
    """Run empty engine steps (each collects the reads that ended) until ``condition`` holds."""
    deadline = time.monotonic() + 30
    while not condition():
        assert time.monotonic() < deadline, what
        kv.prepare_step(reqs)
        time.sleep(0.002)


def no_pins(*stack: KVTier) -> bool:
    return not any(any(tier._pins) for tier in stack)


@pytest.mark.parametrize("scheduler", ["fcfs", "sla-lanes"])
def test_disk_blocks_are_read_beside_the_steps_and_join_the_hit_once_in(tmp_path, scheduler):
    kv, offload, disk, cache = tiers(tmp_path, host_slots=0)  # a disk tier alone, as under --state-dir
    s = make_scheduler(scheduler, kv)
    expected = first_turn_pushed_out(s, kv, cache, HISTORY)
    assert len(disk) >= 3

    turn, stranger = make_request(HISTORY + [9, 7, 7]), make_request([3] * 6)
    s.add_request(turn)
    s.add_request(stranger)
    out = s.schedule()  # returns with the reads held at the gate: the engine's thread did not wait for them
    assert out.scheduled == [stranger], "the request whose blocks are being read ran, or held the queue"
    assert turn.status is RequestStatus.WAITING and turn.num_computed_tokens == 0 and disk.num_reads == 3
    # A running request short of blocks makes the scheduler give up waiting requests' holds first; this one holds no
    # device block (its hit is all on disk, still being read), so its reads go on.
    assert not s._allocate_without_holds(stranger, 2 * NUM_BLOCKS * BLOCK_SIZE)
    kv.prepare_step(out.scheduled)
    computed(kv, cache, out)
    queries = kv.stats.num_prefix_queries
    out = s.schedule()  # its hit is still 0: asking again keeps the reads in flight, and counts no new query
    assert turn not in out.scheduled and disk.num_reads == 3 and kv.stats.num_prefix_queries == queries
    kv.prepare_step(out.scheduled)
    computed(kv, cache, out)

    disk.gate.set()
    wait_ready(kv, turn)
    assert turn.num_computed_tokens == 12, "the blocks read from disk did not join the hit"
    assert disk.reader_threads and all(name.startswith("rtx-kv-read") for name in disk.reader_threads)
    out = s.schedule()
    assert turn in out.scheduled and out.num_scheduled_tokens[out.scheduled.index(turn)] == 3
    kv.prepare_step(out.scheduled)
    assert torch.equal(cache[kv.block_ids(turn.req_id)[:3]], expected)
    assert offload.stats.num_prefetched == 3 and disk.stats.num_loaded == 3
    kv.check_invariants()
    assert no_pins(disk)
    disk.check_invariants()


def test_a_damaged_block_file_ends_the_hit_there(tmp_path):
    kv, offload, disk, cache = tiers(tmp_path, host_slots=0)
    s = make_scheduler("fcfs", kv)
    first_turn_pushed_out(s, kv, cache, HISTORY)
    disk.flush()  # the files are there (until then reads are served from the bytes being written)
    turn = make_request(HISTORY + [9, 7])
    s.add_request(turn)
    assert s.schedule().is_empty
    assert kv.idle_step() == COPY_POLL_S, "an engine with nothing to run but reads in flight should wait, not spin"
    second = disk.path(history_keys()[1])
    raw = bytearray(second.read_bytes())
    raw[-1] ^= 0x40
    second.write_bytes(bytes(raw))
    disk.gate.set()
    wait_ready(kv, turn)
    assert turn.num_computed_tokens == BLOCK_SIZE, "the hit went past the damaged block"
    disk.flush()
    assert disk.stats.num_corrupt == 1 and not second.exists() and kv.idle_step() == 0.0
    assert no_pins(disk)
    disk.check_invariants()
    kv.check_invariants()


def test_a_request_leaving_while_its_blocks_are_read_leaves_them_in_the_tier_above(tmp_path):
    kv, offload, disk, cache = tiers(tmp_path, host_slots=2)
    host = offload.top
    s = make_scheduler("fcfs", kv)
    first_turn_pushed_out(s, kv, cache, HISTORY)
    turn = make_request(HISTORY + [9, 7])
    s.add_request(turn)
    assert s.schedule().is_empty
    keys = history_keys()[:3]
    on_disk_only = [k for k in keys if k not in host]
    assert on_disk_only and disk.num_reads == len(on_disk_only)
    turn.status = RequestStatus.FINISHED_ABORTED
    s.finish_request(turn)
    disk.gate.set()
    steps_until(kv, lambda: offload.stats.num_prefetches_promoted >= len(on_disk_only),
                "the abandoned reads never reached the host tier")
    assert all(k in host for k in on_disk_only[-2:])
    assert no_pins(host, disk)
    host.check_invariants(), disk.check_invariants()
    kv.check_invariants()


def test_reads_started_before_a_reset_of_the_cache_bring_nothing_back(tmp_path):
    kv, offload, disk, cache = tiers(tmp_path, host_slots=1)
    host = offload.top
    s = make_scheduler("fcfs", kv)
    first_turn_pushed_out(s, kv, cache, HISTORY)
    # The host had room for one block: the others are on disk only.
    num_on_disk = sum(key in disk and key not in host for key in history_keys())
    turn = make_request(HISTORY + [9, 7])
    s.add_request(turn)
    assert s.schedule().is_empty and disk.num_reads == num_on_disk >= 2
    held = turn.num_computed_tokens  # the host's block, reloaded at lookup: the request keeps what it holds
    kv.reset_prefix_cache()  # e.g. new weights: what the reads bring is stale
    disk.gate.set()
    wait_ready(kv, turn)
    assert turn.num_computed_tokens == held < len(HISTORY), "stale blocks joined the hit after the reset"
    steps_until(kv, lambda: no_pins(disk), "the reads' pins were never released")
    assert not any(key in host for key in history_keys()) and offload.stats.num_prefetches_promoted == 0
    kv.check_invariants()


def test_two_requests_with_one_prefix_read_it_once(tmp_path):
    kv, offload, disk, cache = tiers(tmp_path, host_slots=0)
    s = make_scheduler("fcfs", kv)
    expected = first_turn_pushed_out(s, kv, cache, HISTORY)
    one, two = make_request(HISTORY + [9, 7]), make_request(HISTORY + [8, 8, 8])
    s.add_request(one)
    s.add_request(two)
    assert s.schedule().is_empty
    assert disk.num_reads == 3
    disk.gate.set()
    wait_ready(kv, one)
    wait_ready(kv, two)
    out = s.schedule()
    assert set(out.scheduled) == {one, two} and one.num_computed_tokens == two.num_computed_tokens == 12
    kv.prepare_step(out.scheduled)
    for req in (one, two):
        assert torch.equal(cache[kv.block_ids(req.req_id)[:3]], expected)
    assert no_pins(disk)
    kv.check_invariants()


def test_a_run_longer_than_the_reads_in_flight_is_read_on_not_computed(tmp_path, monkeypatch):
    """With room for one block's read in flight, each of two requests reads its run one block after the other,
    asking ready() at every step as a scheduler does, and gets the whole hit; none of it is computed."""
    import rtxcore.kv.tiers.prefetch as prefetch_module

    monkeypatch.setattr(prefetch_module, "PREFETCH_BYTES", WIDTH)
    kv, offload, disk, cache = tiers(tmp_path, host_slots=0)
    s = make_scheduler("fcfs", kv)
    expected = first_turn_pushed_out(s, kv, cache, HISTORY)
    disk.gate.set()
    one, two = make_request(HISTORY + [9, 7]), make_request(HISTORY[:8] + [4, 4, 4, 4, 8])
    s.add_request(one)
    s.add_request(two)
    first_step: dict[str, int] = {}  # tokens each request computed in its first step
    for _ in range(1000):
        out = s.schedule()
        for req, n in zip(out.scheduled, out.num_scheduled_tokens):
            if req.req_id not in first_step:
                first_step[req.req_id] = n
                blocks = kv.block_ids(req.req_id)[:req.num_computed_tokens // BLOCK_SIZE]
                assert torch.equal(cache[blocks], expected[:len(blocks)]), "a block came back with other bytes"
        kv.prepare_step(out.scheduled)
        computed(kv, cache, out)
        if len(first_step) == 2:
            break
        time.sleep(0.002)
    else:
        raise AssertionError("the requests never got their disk blocks")
    assert first_step == {one.req_id: 2, two.req_id: 5}, "part of a run on disk was computed instead of read"
    assert offload.stats.num_prefetched == disk.num_reads == 3, "a block was read twice"
    assert no_pins(disk)
    kv.check_invariants()


def test_a_request_placed_without_asking_ready_computes_its_prefix(tmp_path):
    """A third-party scheduler that never asks ready() is still correct: the request computes what the reads would
    have brought, and their pins go once the reads end."""
    kv, offload, disk, cache = tiers(tmp_path, host_slots=0)
    s = make_scheduler("fcfs", kv)
    first_turn_pushed_out(s, kv, cache, HISTORY)
    turn = make_request(HISTORY + [9, 7])
    turn.num_computed_tokens = kv.lookup_prefix(turn)
    assert turn.num_computed_tokens == 0
    assert kv.allocate(turn, turn.num_tokens)
    disk.gate.set()
    steps_until(kv, lambda: no_pins(disk), "the reads' pins were never released", [turn])
    kv.free(turn)
    kv.check_invariants()
    disk.check_invariants()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device: reads into pinned memory on a worker")
def test_on_a_gpu_blocks_read_into_pinned_memory_reach_their_blocks_intact(tmp_path):
    from rtxcore.kv.block_io import read_blocks, write_blocks

    caches = [torch.randn(2, 8, 4, 16, dtype=torch.bfloat16, device="cuda") for _ in range(2)]
    expected = [c.clone() for c in caches]
    block_bytes = sum(c[:, 0].numel() for c in caches) * 2
    disk = DiskTier(tmp_path, 8, block_bytes, POLICIES["lru"](8), bytes(20))
    offload = KVOffload([disk], lambda ids: read_blocks(caches, 1, ids),
                        lambda ids, data: write_blocks(caches, 1, ids, data), device="cuda")
    kv = KVCacheManager(8, BLOCK_SIZE, POLICIES["lru"](8), True, offload)
    disk.store(history_keys(), read_blocks(caches, 1, [1, 2, 3]))
    for c in caches:
        c.zero_()
    req = make_request(HISTORY + [9])
    req.num_computed_tokens = kv.lookup_prefix(req)
    assert req.num_computed_tokens == 0
    wait_ready(kv, req)
    assert req.num_computed_tokens == 12
    kv.prepare_step([req])
    torch.cuda.synchronize()
    blocks = kv.block_ids(req.req_id)[:3]
    for c, e in zip(caches, expected):
        assert torch.equal(c[:, blocks], e[:, [1, 2, 3]])
    kv.free(req)
    kv.check_invariants()
    assert no_pins(disk)
