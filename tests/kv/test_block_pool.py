"""BlockPool: the null block, all-or-nothing allocation, reference counting, caching and eviction."""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from rtxcore.errors import ConfigError
from rtxcore.kv.block_pool import NULL_BLOCK_ID, BlockPool, BlockPoolError
from rtxcore.kv.hashing import hash_block
from tests.helpers.kv import POLICIES, make_pool


def h(n: int) -> bytes:
    return hash_block(None, [n])


def test_null_block_is_never_handed_out():
    pool = make_pool(num_blocks=5)
    assert pool.num_usable_blocks == pool.num_free_blocks == 4
    block_ids = pool.allocate(4)
    assert sorted(block_ids) == [1, 2, 3, 4] and NULL_BLOCK_ID not in block_ids
    assert pool.allocate(1) is None
    assert pool.usage == 1.0
    with pytest.raises(BlockPoolError):
        pool.decref(NULL_BLOCK_ID)


def test_allocate_is_all_or_nothing():
    pool = make_pool(num_blocks=5)
    held = pool.allocate(2)
    assert pool.allocate(3) is None
    assert pool.num_free_blocks == 2
    assert pool.allocate(0) == []
    pool.free_blocks(held)
    assert pool.num_free_blocks == 4 and pool.usage == 0.0
    pool.check_invariants()


def test_double_free_raises():
    pool = make_pool()
    (block_id,) = pool.allocate(1)
    pool.decref(block_id)
    with pytest.raises(BlockPoolError, match="double free"):
        pool.decref(block_id)
    with pytest.raises(BlockPoolError):
        pool.incref(block_id)  # a free block is not a hit
    pool.check_invariants()


def test_cached_block_becomes_evictable_then_is_hit_or_evicted():
    pool = make_pool(num_blocks=3)
    a, b = pool.allocate(2)
    assert pool.cache_block(a, h(1)) == a
    pool.free_blocks([a, b])
    # Evictable blocks still count as free, and a hit takes the block back.
    assert pool.num_free_blocks == 2 and pool.lookup(h(1)) == a and a in pool.policy
    pool.incref(a)
    assert a not in pool.policy and pool.blocks[a].ref_cnt == 1
    pool.decref(a)
    # The uncached block goes first; the cached one only when nothing else is left.
    assert pool.allocate(1) == [b]
    assert pool.allocate(1) == [a]
    assert pool.lookup(h(1)) is None and pool.num_evictions == 1
    pool.check_invariants()


def test_identical_content_is_cached_once():
    pool = make_pool()
    a, b = pool.allocate(2)
    assert pool.cache_block(a, h(7)) == a
    assert pool.cache_block(b, h(7)) == a
    assert pool.blocks[b].block_hash is None
    pool.free_blocks([a, b])
    assert b not in pool.policy and a in pool.policy
    pool.check_invariants()


def test_reset_prefix_cache_keeps_blocks_in_use():
    pool = make_pool()
    a, b = pool.allocate(2)
    pool.cache_block(a, h(1))
    pool.cache_block(b, h(2))
    pool.decref(a)
    assert pool.reset_prefix_cache() == 2
    assert pool.lookup(h(1)) is None and pool.lookup(h(2)) is None
    assert pool.blocks[b].ref_cnt == 1
    pool.decref(b)
    assert len(pool.policy) == 0 and pool.num_free_blocks == pool.num_usable_blocks
    pool.check_invariants()


def test_bad_configuration_is_refused():
    with pytest.raises(ConfigError):
        make_pool(num_blocks=1)
    with pytest.raises(ConfigError):
        BlockPool(8, POLICIES["lru"](4))


class BlockPoolMachine(RuleBasedStateMachine):
    """Random pool operations against a model of who holds what and which hash maps where."""

    policy_name = "lru"
    num_blocks = 7

    def __init__(self):
        super().__init__()
        self.pool = make_pool(self.num_blocks, self.policy_name)
        self.refs: dict[int, int] = {}  # model: block -> references held by the test
        self.cached: dict[bytes, int] = {}  # model: hash -> block

    def _held(self) -> list[int]:
        return sorted(b for b, n in self.refs.items() if n > 0)

    @rule(n=st.integers(0, 4))
    def allocate(self, n):
        before = self.pool.num_free_blocks
        block_ids = self.pool.allocate(n)
        if block_ids is None:
            assert n > before and self.pool.num_free_blocks == before
            return
        assert len(block_ids) == n == len(set(block_ids))
        for block_id in block_ids:
            assert self.refs.get(block_id, 0) == 0, "handed out a block in use"
            assert block_id != NULL_BLOCK_ID
            self.refs[block_id] = 1
            # An evicted block's hash is gone from the map.
            self.cached = {k: v for k, v in self.cached.items() if v != block_id}

    @precondition(lambda self: self._held())
    @rule(data=st.data(), key=st.integers(0, 5))
    def cache(self, data, key):
        block_id = data.draw(st.sampled_from(self._held()))
        if self.pool.blocks[block_id].block_hash is not None:
            return
        result = self.pool.cache_block(block_id, h(key))
        expected = self.cached.setdefault(h(key), block_id)
        assert result == expected

    @precondition(lambda self: self._held())
    @rule(data=st.data())
    def free(self, data):
        block_id = data.draw(st.sampled_from(self._held()))
        self.pool.decref(block_id)
        self.refs[block_id] -= 1

    @rule(key=st.integers(0, 5))
    def hit(self, key):
        block_id = self.pool.lookup(h(key))
        assert block_id == self.cached.get(h(key))
        if block_id is not None:
            self.pool.incref(block_id)
            self.refs[block_id] = self.refs.get(block_id, 0) + 1

    @rule()
    def double_free_raises(self):
        unheld = [b for b in range(1, self.num_blocks) if self.refs.get(b, 0) == 0]
        if unheld:
            with pytest.raises(BlockPoolError):
                self.pool.decref(unheld[0])

    @rule()
    def reset(self):
        self.pool.reset_prefix_cache()
        self.cached.clear()

    @invariant()
    def consistent(self):
        self.pool.check_invariants()
        for block in self.pool.blocks:
            assert block.ref_cnt == self.refs.get(block.block_id, 0)
        assert self.pool.num_free_blocks == self.pool.num_usable_blocks - len(self._held())
        assert {k: self.pool.lookup(k) for k in self.cached} == self.cached

    def teardown(self):
        for block_id in self._held():
            for _ in range(self.refs[block_id]):
                self.pool.decref(block_id)
        self.pool.check_invariants()
        assert self.pool.num_free_blocks == self.pool.num_usable_blocks, "blocks leaked"


class LFUBlockPoolMachine(BlockPoolMachine):
    policy_name = "lfu"


_settings = settings(max_examples=60, stateful_step_count=40, deadline=None)
TestBlockPoolLRU = BlockPoolMachine.TestCase
TestBlockPoolLRU.settings = _settings
TestBlockPoolLFU = LFUBlockPoolMachine.TestCase
TestBlockPoolLFU.settings = _settings
