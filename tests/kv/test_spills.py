"""Spills: what the device's evictions copy down to the lower tiers. A block some lower tier holds already is only
touched there, never copied again (no thrashing between the device and the tiers)."""

from __future__ import annotations

import torch

from rtxcore.kv.manager import KVCacheManager
from rtxcore.kv.tiers.host import HostTier
from rtxcore.kv.tiers.offload import KVOffload
from tests.helpers.kv import POLICIES, make_request
from tests.kv.test_kv_tiers import BLOCK_BYTES, tier_chain


def bounce_two_prompts(tiers, after_each=lambda: None):
    """Two 9-token prompts taking turns three times on a device of 4 blocks (3 usable): running one evicts the
    other's blocks into ``tiers``. Returns the cache, its offload and the device blocks each copy down read."""
    device = torch.zeros((4, BLOCK_BYTES), dtype=torch.uint8)
    copies: list[list[int]] = []

    def read_blocks(block_ids):
        copies.append(block_ids)
        return device[block_ids].clone()

    def write_blocks(block_ids, data):
        device[block_ids] = data

    offload = KVOffload(tiers, read_blocks, write_blocks)
    kv = KVCacheManager(4, 4, POLICIES["lru"](4), offload=offload)
    a, b = make_request([1, 2, 3, 4, 5, 6, 7, 8, 9]), make_request([11, 12, 13, 14, 15, 16, 17, 18, 19])
    for _ in range(3):
        for req in (a, b):
            req.num_computed_tokens = kv.lookup_prefix(req)
            assert kv.allocate(req, req.num_tokens - req.num_computed_tokens)
            req.num_computed_tokens = req.num_tokens
            kv.free(req)
            req.num_computed_tokens = 0
            after_each()
    return kv, offload, copies


def test_a_block_bouncing_between_device_and_host_is_copied_down_once():
    """Inclusive tiers: the host keeps its copy when a block goes back to the device, so evicting it again is a
    touch, not a second copy (no thrashing)."""
    host = HostTier(8, BLOCK_BYTES, POLICIES["lru"](8))
    kv, offload, copies = bounce_two_prompts([host])
    # Four full blocks (two per prompt) were copied down once each, then only touched on later evictions.
    assert host.stats.num_stored == 4 and sum(len(c) for c in copies) == 4
    assert offload.stats.num_spill_hits > 0 and offload.stats.num_reloaded > 0
    kv.check_invariants(), host.check_invariants()


def test_a_block_the_disk_holds_is_not_copied_down_again(tmp_path):
    """A host tier too small for the blocks over a disk with room for all: each block is copied down once and
    written through to disk; evicted from the device again after the host tier let it go, it stays on disk alone
    (a spill hit there), not copied to the host a second time."""
    host, disk = tier_chain(tmp_path, 3, 16)
    kv, offload, copies = bounce_two_prompts([host, disk], after_each=disk.flush)
    # Four full blocks, each copied down once: later evictions found them on disk (or still in the host tier).
    assert sum(len(c) for c in copies) == 4 and offload.stats.num_spilled == 4
    assert len(disk) == 4 and offload.stats.num_spill_hits >= 4
    kv.check_invariants(), host.check_invariants(), disk.check_invariants()
