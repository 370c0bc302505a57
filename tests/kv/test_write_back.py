"""Write-back: computed prefix-cache blocks copied to the first lower tier in batches, ahead of their eviction
(rtxcore/kv/tiers/write_back.py), so that evicting them copies nothing; checked on the CPU with the write-back
forced on (by default it runs on a GPU only)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import settings

from rtxcore.kv.manager import KVCacheManager
from rtxcore.kv.tiers.host import HostTier
from rtxcore.kv.tiers.offload import KVOffload
from tests.helpers.kv import POLICIES, make_request
from tests.kv.test_kv_tiers import TieredWorkloadMachine

BLOCK_SIZE = 4
WIDTH = 8  # bytes per block


class Device:
    """A backend's cache as one tensor; a step "computes" a block by writing its first token into every byte, and
    only when the step runs (after prepare_step), as a real backend's forward pass does."""

    def __init__(self, num_blocks: int):
        self.blocks = torch.zeros((num_blocks, WIDTH), dtype=torch.uint8)
        self.copied: list[list[int]] = []

    def read(self, block_ids: list[int]) -> torch.Tensor:
        self.copied.append(list(block_ids))
        return self.blocks[block_ids].clone()

    def write(self, block_ids: list[int], data: torch.Tensor) -> None:
        self.blocks[block_ids] = data


def make_kv(num_blocks: int, host_slots: int, batch_blocks: int) -> tuple[KVCacheManager, HostTier, Device]:
    device = Device(num_blocks)
    host = HostTier(host_slots, WIDTH, POLICIES["lru"](host_slots))
    kv = KVCacheManager(num_blocks, BLOCK_SIZE, POLICIES["lru"](num_blocks),
                        offload=KVOffload([host], device.read, device.write), write_back=True)
    assert kv.write_back is not None
    kv.write_back.batch_blocks = batch_blocks
    return kv, host, device


def run_step(kv: KVCacheManager, device: Device, req) -> None:
    """Schedule all of ``req``'s tokens, launch (prepare_step), then compute them."""
    req.num_computed_tokens = kv.lookup_prefix(req)
    assert kv.allocate(req, req.num_tokens - req.num_computed_tokens)
    kv.prepare_step([req])
    for i, block_id in enumerate(kv.block_ids(req.req_id)):
        if i * BLOCK_SIZE >= req.num_computed_tokens:
            device.blocks[block_id] = req.all_token_ids[i * BLOCK_SIZE]
    req.num_computed_tokens = req.num_tokens
    kv.free(req)
    req.num_computed_tokens = 0


def prompt(first: int) -> list[int]:
    """Two full blocks whose first tokens are ``first`` and ``first + 1``, and one token more."""
    return [first] * BLOCK_SIZE + [first + 1] * BLOCK_SIZE + [0]


def test_blocks_go_down_in_batches_after_their_step_and_their_eviction_copies_nothing():
    kv, host, device = make_kv(num_blocks=9, host_slots=32, batch_blocks=4)
    for first in (10, 20, 30):  # 6 full blocks: the pool's 8 usable blocks are 7/8 full from the third request
        run_step(kv, device, make_request(prompt(first)))
    # The third step's launch copied down the first two requests' blocks, in one batch, with what their steps wrote
    # (never the bytes of a block before its step ran).
    assert kv.offload.stats.num_written_back == 4 and device.copied == [sorted(device.copied[0])]
    assert len(host) == 4
    for k in host.keys():
        block_id = kv.pool.lookup(k)
        assert block_id is not None and torch.equal(host.peek(k), device.blocks[block_id])
    # New prompts evict three of those blocks (the pool's least recently used): each a spill hit, none copied.
    run_step(kv, device, make_request(prompt(40)))
    run_step(kv, device, make_request(prompt(50)))
    assert kv.offload.stats.num_spill_hits == 3 and kv.offload.stats.num_spilled == 0
    kv.check_invariants(), host.check_invariants()


def test_reloaded_blocks_hold_what_was_computed():
    kv, host, device = make_kv(num_blocks=9, host_slots=32, batch_blocks=2)
    firsts = [10, 20, 30, 40, 50, 60]
    for first in firsts:
        run_step(kv, device, make_request(prompt(first)))
    assert kv.offload.stats.num_written_back > 0
    for first in firsts:  # every prompt's two blocks are a hit, on the device or reloaded from the host
        req = make_request(prompt(first))
        assert kv.lookup_prefix(req) == 2 * BLOCK_SIZE
        held = kv.block_ids(req.req_id)
        assert [int(device.blocks[b][0]) for b in held] == [first, first + 1]
        kv.free(req)
    kv.check_invariants(), host.check_invariants()


def test_nothing_is_written_back_while_the_device_cache_has_room():
    kv, host, device = make_kv(num_blocks=33, host_slots=32, batch_blocks=2)
    for first in (10, 20, 30, 40):  # 8 of 32 usable blocks
        run_step(kv, device, make_request(prompt(first)))
    assert kv.offload.stats.num_written_back == 0 and len(host) == 0 and device.copied == []


def test_a_full_tier_takes_no_write_back():
    kv, host, device = make_kv(num_blocks=9, host_slots=3, batch_blocks=4)
    for first in (10, 20, 30, 40):
        run_step(kv, device, make_request(prompt(first)))
    # Fewer free slots than a batch: blocks are copied only when evicted, as without write-back (a store would push
    # out a block only the tier holds, for one the device still has).
    assert kv.offload.stats.num_written_back == 0 and kv.offload.stats.num_spilled > 0


class WriteBackWorkloadMachine(TieredWorkloadMachine):
    """The tiered random workload with blocks written back one at a time: every block that comes back from a tier
    must hold the tokens computed into it."""

    write_back = True

    def __init__(self):
        super().__init__()
        assert self.kv.write_back is not None
        self.kv.write_back.batch_blocks = 1


TestWriteBackWorkload = WriteBackWorkloadMachine.TestCase
TestWriteBackWorkload.settings = settings(max_examples=30, stateful_step_count=40, deadline=None)


# About a tenth of a second of GPU time before each step's launch: a copy to the host that overtook the gather, or
# a step that overwrote a block before its copy, would show in the bytes.
_GPU_SLEEP_CYCLES = 2 * 10**8


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device: copies on its streams are the check")
@pytest.mark.parametrize("evict_ahead", [False, True], ids=["on-demand", "evict-ahead"])
def test_on_a_gpu_blocks_go_down_beside_the_steps_with_what_their_steps_wrote(evict_ahead):
    """On a GPU over a host tier write-back and evicting ahead are on by default: whatever the steps' stream is
    still busy with, every block in the host tier must hold the bytes its step computed, and the steps must be free
    to overwrite blocks right after a spill (at allocation, or in a batch before a launch)."""
    from rtxcore.kv.block_io import read_blocks, write_blocks

    num_blocks, width = 17, 4096  # bytes per block, as 2,048 bf16 values
    cache = torch.zeros((num_blocks, width // 2), dtype=torch.bfloat16, device="cuda")
    host = HostTier(64, width, POLICIES["lru"](64), pin_memory=True)
    offload = KVOffload([host], lambda ids: read_blocks([cache], 0, ids),
                        lambda ids, data: write_blocks([cache], 0, ids, data), device="cuda")
    kv = KVCacheManager(num_blocks, BLOCK_SIZE, POLICIES["lru"](num_blocks), offload=offload)
    assert kv.write_back is not None and kv.evict_ahead is not None
    kv.write_back.batch_blocks = 4
    kv.evict_ahead.low, kv.evict_ahead.batch = (3, 3) if evict_ahead else (0, 3)
    value_of: dict[bytes, float] = {}
    for first in range(1, 41):
        req = make_request(prompt(first))
        req.num_computed_tokens = kv.lookup_prefix(req)
        assert kv.allocate(req, req.num_tokens - req.num_computed_tokens)
        torch.cuda._sleep(_GPU_SLEEP_CYCLES)  # the step in flight
        kv.prepare_step([req])
        state_blocks = kv.block_ids(req.req_id)
        for i, block_id in enumerate(state_blocks):
            if i * BLOCK_SIZE >= req.num_computed_tokens:
                cache[block_id] = float(req.all_token_ids[i * BLOCK_SIZE])  # the step computes its blocks
        for i, block_id in enumerate(state_blocks[:2]):
            k = kv.pool.blocks[block_id].block_hash
            if k is not None:
                value_of[k] = float(first + i)
        req.num_computed_tokens = req.num_tokens
        kv.free(req)
    torch.cuda.synchronize()
    stats = offload.stats
    assert stats.num_written_back > 0 and stats.num_spill_hits > 0 and len(host) > 0
    assert (kv.evict_ahead.num_evicted > 0) == evict_ahead
    for k in host.keys():
        row = host.peek(k).view(torch.bfloat16)
        assert torch.all(row == value_of[k]), f"block {k.hex()} went down with the wrong bytes"
    kv.check_invariants(), host.check_invariants()
