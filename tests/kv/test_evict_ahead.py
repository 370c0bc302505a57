"""Evicting ahead: prefix-cache blocks evicted to the first lower tier in batches before a step's launch, so that
the next allocations take empty blocks and spill nothing (rtxcore/kv/tiers/evict_ahead.py); checked on the CPU with
it forced on (by default it runs on a GPU only; tests/kv/test_write_back.py checks the GPU's stream order)."""

from __future__ import annotations

from hypothesis import settings

from rtxcore.kv.block_pool import BlockPool
from rtxcore.kv.manager import KVCacheManager
from rtxcore.kv.tiers.evict_ahead import MIN_POOL_BATCHES, EvictAhead
from rtxcore.kv.tiers.host import HostTier
from rtxcore.kv.tiers.offload import KVOffload
from tests.helpers.kv import POLICIES, make_request
from tests.kv.test_kv_tiers import TieredWorkloadMachine
from tests.kv.test_write_back import BLOCK_SIZE, WIDTH, Device, prompt, run_step


def make_kv(num_blocks: int, host_slots: int, batch: int) -> tuple[KVCacheManager, HostTier, Device]:
    device = Device(num_blocks)
    host = HostTier(host_slots, WIDTH, POLICIES["lru"](host_slots))
    kv = KVCacheManager(num_blocks, BLOCK_SIZE, POLICIES["lru"](num_blocks),
                        offload=KVOffload([host], device.read, device.write), write_back=False, evict_ahead=True)
    assert kv.evict_ahead is not None
    kv.evict_ahead.low = kv.evict_ahead.batch = batch
    return kv, host, device


def test_blocks_leave_in_one_batch_and_the_next_allocations_spill_nothing():
    kv, host, device = make_kv(num_blocks=13, host_slots=32, batch=4)
    spills: list[list[int]] = []
    spill = kv.pool.on_evict
    assert spill is not None
    kv.pool.on_evict = lambda victims: (spills.append([b for b, _ in victims]), spill(victims))
    for first in (10, 20, 30, 40):  # two cached blocks each, and one block more while a request runs
        run_step(kv, device, make_request(prompt(first)))
    # The fourth step's launch found 3 of the 12 usable blocks empty (fewer than 4): it evicted the four least
    # recently used blocks, the first two prompts', in one spill, with what their steps wrote.
    assert len(spills) == 1 and len(spills[0]) == 4 and kv.offload.stats.num_spilled == 4
    assert sorted(int(host.peek(k)[0]) for k in host.keys()) == [10, 11, 20, 21]
    # Three more prompts: their allocations take empty blocks (no spill of their own); each batch leaves at a launch.
    for first in (50, 60, 70):
        run_step(kv, device, make_request(prompt(first)))
    assert len(spills) == kv.evict_ahead.num_batches == 2 and all(len(s) == 4 for s in spills)
    kv.check_invariants(), host.check_invariants()


def test_evicted_blocks_come_back_with_what_was_computed():
    kv, host, device = make_kv(num_blocks=13, host_slots=32, batch=4)
    firsts = [10, 20, 30, 40, 50, 60, 70, 80]
    for first in firsts:
        run_step(kv, device, make_request(prompt(first)))
    assert kv.evict_ahead.num_evicted >= 8
    for first in firsts:  # every prompt's two blocks are a hit, on the device or reloaded from the host
        req = make_request(prompt(first))
        assert kv.lookup_prefix(req) == 2 * BLOCK_SIZE
        assert [int(device.blocks[b][0]) for b in kv.block_ids(req.req_id)] == [first, first + 1]
        kv.free(req)
    kv.check_invariants(), host.check_invariants()


def test_nothing_leaves_while_the_pool_has_empty_blocks_and_a_small_pool_keeps_no_reserve():
    kv, host, device = make_kv(num_blocks=33, host_slots=32, batch=4)
    for first in (10, 20, 30, 40):  # 8 of 32 usable blocks
        run_step(kv, device, make_request(prompt(first)))
    assert kv.evict_ahead.num_evicted == 0 and len(host) == 0 and device.copied == []
    small = BlockPool(MIN_POOL_BATCHES * 4, POLICIES["lru"](MIN_POOL_BATCHES * 4))
    assert EvictAhead(small, batch=4).low == 0  # 15 batches of room: no reserve
    assert EvictAhead(BlockPool(MIN_POOL_BATCHES * 4 + 1, POLICIES["lru"](MIN_POOL_BATCHES * 4 + 1)), batch=4).low == 2


def test_an_allocation_from_the_reserve_counts_as_evicting():
    kv, _, device = make_kv(num_blocks=13, host_slots=32, batch=4)
    for first in (10, 20, 30, 40, 50):
        run_step(kv, device, make_request(prompt(first)))
    before = kv.pool.pressure
    run_step(kv, device, make_request(prompt(60)))  # its blocks come from the reserve the last launch evicted
    assert kv.pool.pressure > before


class EvictAheadWorkloadMachine(TieredWorkloadMachine):
    """The tiered random workload with blocks evicted ahead one at a time whenever fewer than two are empty: every
    block that comes back from a tier must hold the tokens computed into it."""

    evict_ahead = True

    def __init__(self):
        super().__init__()
        assert self.kv.evict_ahead is not None
        self.kv.evict_ahead.low, self.kv.evict_ahead.batch = 2, 1


TestEvictAheadWorkload = EvictAheadWorkloadMachine.TestCase
TestEvictAheadWorkload.settings = settings(max_examples=30, stateful_step_count=40, deadline=None)
