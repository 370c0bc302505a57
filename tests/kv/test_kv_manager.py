"""KVCacheManager: prefix hits, allocation, freeing, preemption, stats."""

from __future__ import annotations

import pytest

import rtxcore.kv.manager as manager_module
from rtxcore.kv.block_pool import BlockPoolError
from rtxcore.kv.hashing import hash_blocks
from tests.helpers.kv import make_manager, make_request, schedule


def test_shared_prefix_hits_the_same_blocks():
    kv = make_manager(block_size=4)
    a = make_request(range(10))
    assert schedule(kv, a)
    b = make_request([*range(8), 50, 51, 52])
    assert kv.lookup_prefix(b) == 8
    assert kv.block_ids(b.req_id) == kv.block_ids(a.req_id)[:2]
    assert kv.pool.blocks[kv.block_ids(a.req_id)[0]].ref_cnt == 2
    kv.check_invariants()


def test_lookup_always_leaves_a_token_to_compute():
    kv = make_manager(block_size=4)
    assert schedule(kv, make_request(range(8)))
    assert kv.lookup_prefix(make_request(range(8))) == 4
    assert kv.lookup_prefix(make_request(range(9))) == 8
    assert kv.lookup_prefix(make_request([0])) == 0


def test_cache_salt_separates_requests():
    kv = make_manager(block_size=4)
    assert schedule(kv, make_request(range(9), cache_salt="alice"))
    assert kv.lookup_prefix(make_request(range(9), cache_salt="bob")) == 0
    assert kv.lookup_prefix(make_request(range(9))) == 0
    assert kv.lookup_prefix(make_request(range(9), cache_salt="alice")) == 8


def test_preempted_request_finds_its_blocks_again():
    kv = make_manager(block_size=4)
    req = make_request(range(10))
    assert schedule(kv, req)
    for token in (70, 71, 72):  # decode: the sampled token is computed in the next step
        req.all_token_ids.append(token)
        assert schedule(kv, req, 1)
    kv.free(req)
    req.num_computed_tokens = 0
    assert kv.lookup_prefix(req) == 12  # 13 tokens: three full blocks, one token left to compute
    kv.check_invariants()


def test_failed_allocate_changes_nothing():
    kv = make_manager(num_blocks=4, block_size=4)  # 3 usable blocks
    a = make_request(range(6))
    assert schedule(kv, a)
    before = (kv.num_free_blocks, kv.block_ids(a.req_id))
    assert not kv.allocate(a, 20)
    assert (kv.num_free_blocks, kv.block_ids(a.req_id)) == before
    b = make_request(range(100, 120))
    assert not schedule(kv, b)
    assert kv.block_ids(b.req_id) == []
    kv.check_invariants()


def test_free_is_idempotent():
    kv = make_manager()
    req = make_request(range(5))
    kv.free(req)
    assert schedule(kv, req)
    kv.free(req)
    kv.free(req)
    assert kv.num_free_blocks == kv.num_usable_blocks
    kv.check_invariants()


def test_free_releases_the_tail_of_a_chain_first():
    kv = make_manager(num_blocks=5, block_size=4, policy="lru")  # 4 usable blocks
    a = make_request(range(13))  # three full blocks plus one token
    assert schedule(kv, a)
    kv.free(a)
    # Needs two blocks: the uncached one, then an eviction, which must take a's last full block.
    assert schedule(kv, make_request(range(100, 105)))
    assert kv.stats.num_evictions == 1
    assert kv.lookup_prefix(make_request(range(13))) == 8


def test_lfu_keeps_a_hot_prefix_over_a_recent_cold_one():
    kv = make_manager(num_blocks=6, block_size=4, policy="lfu")  # 5 usable blocks
    hot = list(range(8))
    for _ in range(3):
        req = make_request([*hot, 99])
        assert schedule(kv, req)
        kv.free(req)
    cold = make_request([*range(50, 58), 99])
    assert schedule(kv, cold)
    kv.free(cold)
    # Needs 3 blocks: the 1 uncached free block, then 2 evictions, which must hit the cold chain, released last.
    assert schedule(kv, make_request(range(200, 209)))
    assert kv.lookup_prefix(make_request([*hot, 1])) == 8
    assert kv.lookup_prefix(make_request([*range(50, 58), 1])) == 0


def test_identical_blocks_are_cached_once():
    kv = make_manager(block_size=4)
    a, b = make_request(range(9)), make_request(range(9))
    assert kv.lookup_prefix(a) == kv.lookup_prefix(b) == 0
    assert schedule(kv, a) and schedule(kv, b)
    assert kv.pool.num_cached_blocks == 2
    kv.free(a)
    kv.free(b)
    assert len(kv.pool.policy) == 2
    kv.check_invariants()


def test_hashing_is_incremental(monkeypatch):
    num_hashed: list[int] = []

    def counting_hash_blocks(token_ids, *args):
        num_hashed.append(len(token_ids))
        return hash_blocks(token_ids, *args)

    monkeypatch.setattr(manager_module, "hash_blocks", counting_hash_blocks)
    kv = make_manager(num_blocks=32, block_size=4)
    req = make_request(range(10))
    assert schedule(kv, req)
    for token in range(30):
        req.all_token_ids.append(token)
        assert schedule(kv, req, 1)
    # Every token of every full block hashed exactly once over 31 steps.
    assert sum(num_hashed) == (req.num_tokens // 4) * 4


def test_stats_count_lookups_and_hits():
    kv = make_manager(block_size=4)
    assert schedule(kv, make_request(range(10)))
    kv.lookup_prefix(make_request(range(9)))
    stats = kv.stats
    assert (stats.num_prefix_queries, stats.num_prefix_query_tokens, stats.num_prefix_hit_tokens) == (2, 19, 8)
    assert stats.prefix_hit_rate == pytest.approx(8 / 19)


def test_repeated_lookup_replaces_the_hold_but_not_after_allocate():
    kv = make_manager(block_size=4)
    assert schedule(kv, make_request(range(9)))
    req = make_request(range(9))
    assert kv.lookup_prefix(req) == 8
    assert kv.lookup_prefix(req) == 8
    kv.check_invariants()
    with pytest.raises(BlockPoolError, match="num_computed_tokens"):
        kv.allocate(req, 9)  # would recompute (overwrite) the shared cached blocks
    req.num_computed_tokens = 8
    assert kv.allocate(req, 1)
    with pytest.raises(BlockPoolError):
        kv.lookup_prefix(req)


def test_without_prefix_caching_nothing_is_shared():
    kv = make_manager(block_size=4, enable_prefix_caching=False)
    assert schedule(kv, make_request(range(9)))
    assert kv.lookup_prefix(make_request(range(9))) == 0
    assert kv.pool.num_cached_blocks == 0 and kv.stats.num_prefix_queries == 0


def test_reset_prefix_cache_forgets_hits():
    kv = make_manager(block_size=4)
    req = make_request(range(9))
    assert schedule(kv, req)
    assert kv.reset_prefix_cache() == 2
    kv.free(req)
    assert kv.lookup_prefix(make_request(range(9))) == 0
    kv.check_invariants()


def test_sizes():
    kv = make_manager(num_blocks=9, block_size=4)
    assert (kv.num_blocks, kv.num_usable_blocks, kv.block_size) == (9, 8, 4)
    assert [kv.blocks_needed(n) for n in (0, 1, 4, 5)] == [0, 1, 1, 2]
    req = make_request(range(8))
    assert schedule(kv, req)
    assert kv.usage == pytest.approx(2 / 8)
    assert len(kv.block_ids(req.req_id)) == 2 and 0 not in kv.block_ids(req.req_id)
    assert kv.block_ids("unknown") == []


def test_blocks_taken_back_before_they_were_computed_leave_the_cache():
    """A scheduler may preempt a request in the very step that allocated it: the blocks allocate() registered were
    never computed, so no later request may hit them."""
    kv = make_manager(num_blocks=8, block_size=4)
    req = make_request(list(range(1, 10)))
    assert kv.lookup_prefix(req) == 0
    assert kv.allocate(req, 9)  # registers blocks 0-1 (8 known tokens) in the cache
    assert kv.num_cached_blocks == 2
    kv.free(req)  # taken back: num_computed_tokens never advanced
    assert kv.num_cached_blocks == 0
    assert kv.lookup_prefix(make_request(list(range(1, 10)))) == 0
    kv.check_invariants()
