"""KVCacheManager and block hashing: prefix hits, allocation, freeing, preemption, and random workloads."""

from __future__ import annotations

import os
import random
import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

import rtxcore.kv.manager as manager_module
from kv_helpers import make_manager, make_request, schedule
from rtxcore.kv.block_pool import BlockPoolError
from rtxcore.kv.hashing import hash_block, hash_blocks
from rtxcore.request import Request

# ---- hashing ----------------------------------------------------------------------------------------------------


def test_block_hash_is_pinned():
    # Persisted indexes depend on these exact values: a change here needs a HASH_VERSION bump.
    first = hash_block(None, [1, 2, 3, 4])
    assert first.hex() == "19421cb88bc8094210a7602153406384"
    assert hash_block(first, [5, 6, 7, 8], "salt").hex() == "0d23bb9eef584bfbb9036b7bc68b01ef"


def test_block_hash_is_stable_across_processes():
    code = "from rtxcore.kv.hashing import hash_blocks; print(hash_blocks(list(range(20)), 4, 'x')[-1].hex())"
    outputs = {
        subprocess.run([sys.executable, "-c", code], env={**os.environ, "PYTHONHASHSEED": seed},
                       capture_output=True, text=True, check=True).stdout.strip()
        for seed in ("1", "2")
    }
    assert outputs == {hash_blocks(list(range(20)), 4, "x")[-1].hex()}


def test_block_hash_separates_parent_tokens_and_extra_key():
    parent = hash_block(None, [9])
    variants = {
        hash_block(None, [1, 2]),
        hash_block(parent, [1, 2]),
        hash_block(None, [2, 1]),
        hash_block(None, [1, 2], "a"),
        hash_block(None, [1, 2], b"a"),
        hash_block(None, [1, 2], ""),
    }
    assert len(variants) == 6
    with pytest.raises(ValueError):
        hash_block(None, [2**31])


def test_hash_blocks_skips_partial_block_and_extends():
    tokens = list(range(11))
    full = hash_blocks(tokens, 4)
    assert len(full) == 2
    assert hash_blocks(tokens[4:], 4, parent=full[0]) == full[1:]


# ---- manager ------------------------------------------------------------------------------------------------------


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


# ---- random workloads ---------------------------------------------------------------------------------------------

PREFIXES = [list(range(1, 10)), list(range(100, 106)), [7] * 8]


class WorkloadMachine(RuleBasedStateMachine):
    """Requests with shared prefixes go through admission, chunked prefill, decode, preemption and finish.

    The test plays the backend: it records which tokens are written into each block, and checks every prefix
    hit against that record, so a hit can only ever return the same tokens (and salt) the request asked for.
    """

    policy_name = "lru"
    block_size = 4
    num_blocks = 10

    def __init__(self):
        super().__init__()
        self.kv = make_manager(self.num_blocks, self.block_size, self.policy_name)
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self.content: dict[int, list[int | None]] = {}  # block -> token per slot, as "computed"
        self.salt_of: dict[int, str | None] = {}
        self.next_token = 1000

    def _holders(self, block_id: int, excluding: Request) -> int:
        reqs = [r for r in self.waiting + self.running if r is not excluding]
        return sum(block_id in self.kv.block_ids(r.req_id) for r in reqs)

    def _allocate_and_compute(self, req: Request, num_new: int) -> bool:
        before = self.kv.block_ids(req.req_id)
        num_free = self.kv.num_free_blocks
        if not self.kv.allocate(req, num_new):
            assert self.kv.block_ids(req.req_id) == before and self.kv.num_free_blocks == num_free
            return False
        block_ids = self.kv.block_ids(req.req_id)
        assert block_ids[:len(before)] == before
        for block_id in block_ids[len(before):]:
            assert self._holders(block_id, req) == 0, "a block in use was handed out again"
            self.content[block_id] = [None] * self.block_size
        for pos in range(req.num_computed_tokens, req.num_computed_tokens + num_new):
            block_id = block_ids[pos // self.block_size]
            assert self.kv.pool.blocks[block_id].ref_cnt == 1, "writing into a block someone else reads"
            self.content[block_id][pos % self.block_size] = req.all_token_ids[pos]
            self.salt_of[block_id] = req.cache_salt
        req.num_computed_tokens += num_new
        return True

    def _preempt(self, req: Request) -> None:
        self.kv.free(req)
        req.num_computed_tokens = 0
        self.running.remove(req)
        self.waiting.append(req)

    @rule(prefix=st.sampled_from(range(len(PREFIXES))), suffix=st.lists(st.integers(0, 3), max_size=6),
          salt=st.sampled_from([None, None, "s"]), max_tokens=st.integers(1, 8))
    def add_request(self, prefix, suffix, salt, max_tokens):
        tokens = PREFIXES[prefix] + suffix
        self.waiting.append(make_request(tokens, cache_salt=salt, max_tokens=max_tokens))

    @initialize(num_requests=st.integers(2, 5), seed=st.integers(0, 2**16))
    def start_with_requests(self, num_requests, seed):
        rng = random.Random(seed)
        for _ in range(num_requests):
            self.add_request(rng.randrange(len(PREFIXES)), [rng.randrange(4) for _ in range(rng.randrange(7))],
                             rng.choice([None, None, "s"]), rng.randint(1, 8))

    @precondition(lambda self: self.waiting)
    @rule(pick=st.integers(0, 7), chunk=st.integers(1, 12))
    def admit(self, pick, chunk):
        req = self.waiting[pick % len(self.waiting)]
        num_hit = self.kv.lookup_prefix(req)
        assert num_hit % self.block_size == 0 and 0 <= num_hit < req.num_tokens
        for i, block_id in enumerate(self.kv.block_ids(req.req_id)):
            expected = req.all_token_ids[i * self.block_size:(i + 1) * self.block_size]
            assert self.content[block_id] == expected and self.salt_of[block_id] == req.cache_salt
        req.num_computed_tokens = num_hit
        if self._allocate_and_compute(req, min(chunk, req.num_tokens - num_hit)):
            self.waiting.remove(req)
            self.running.append(req)
        else:
            self.kv.free(req)  # drop the lookup's hold; admission is retried later
            req.num_computed_tokens = 0

    @precondition(lambda self: self.running)
    @rule(pick=st.integers(0, 7), chunk=st.integers(1, 12))
    def step(self, pick, chunk):
        req = self.running[pick % len(self.running)]
        if req.num_computed_tokens == req.num_tokens:  # prefill done: sample, then compute the sampled token
            if req.num_output_tokens >= req.params.max_tokens:
                self.running.remove(req)
                self.kv.free(req)
                return
            req.all_token_ids.append(self.next_token % 4)
            self.next_token += 1
        num_new = min(chunk, req.num_tokens - req.num_computed_tokens)
        if not self._allocate_and_compute(req, num_new):
            self._preempt(req)

    @precondition(lambda self: self.running)
    @rule(pick=st.integers(0, 7))
    def preempt(self, pick):
        self._preempt(self.running[pick % len(self.running)])

    @precondition(lambda self: self.running or self.waiting)
    @rule(pick=st.integers(0, 7))
    def abort(self, pick):
        reqs = self.running + self.waiting
        req = reqs[pick % len(reqs)]
        (self.running if req in self.running else self.waiting).remove(req)
        self.kv.free(req)

    @rule()
    def reset_prefix_cache(self):
        # Blocks in use stay with their requests; their later content just is not cached.
        self.kv.reset_prefix_cache()

    @invariant()
    def consistent(self):
        self.kv.check_invariants()
        held = {b for r in self.running for b in self.kv.block_ids(r.req_id)}
        assert self.kv.num_free_blocks == self.kv.num_usable_blocks - len(held)
        assert 0.0 <= self.kv.usage <= 1.0
        assert all(not self.kv.block_ids(r.req_id) for r in self.waiting)

    def teardown(self):
        for req in self.running + self.waiting:
            self.kv.free(req)
        self.kv.check_invariants()
        assert self.kv.num_free_blocks == self.kv.num_usable_blocks, "blocks leaked"
        assert all(b.ref_cnt == 0 for b in self.kv.pool.blocks)


class LFUWorkloadMachine(WorkloadMachine):
    policy_name = "lfu"


class SmallBlockWorkloadMachine(WorkloadMachine):
    block_size = 2
    num_blocks = 14


_settings = settings(max_examples=60, stateful_step_count=50, deadline=None)
TestWorkloadLRU = WorkloadMachine.TestCase
TestWorkloadLRU.settings = _settings
TestWorkloadLFU = LFUWorkloadMachine.TestCase
TestWorkloadLFU.settings = _settings
TestWorkloadSmallBlocks = SmallBlockWorkloadMachine.TestCase
TestWorkloadSmallBlocks.settings = _settings


@pytest.mark.parametrize("machine", [WorkloadMachine, LFUWorkloadMachine, SmallBlockWorkloadMachine])
@settings(max_examples=8, deadline=None)
@given(rng=st.randoms(use_true_random=False))
def test_long_random_workload(machine, rng):
    """Long runs the rule-based search rarely reaches: sustained pressure, many evictions and repeated hits."""
    m = machine()
    ops = [(m.add_request, 3), (m.admit, 4), (m.step, 8), (m.preempt, 1), (m.abort, 1), (m.reset_prefix_cache, 0.05)]
    for _ in range(400):
        op = rng.choices([op for op, _ in ops], weights=[w for _, w in ops])[0]
        if op == m.add_request:
            op(rng.randrange(len(PREFIXES)), [rng.randrange(4) for _ in range(rng.randrange(7))],
               rng.choice([None, None, "s"]), rng.randint(1, 8))
        elif op in (m.admit, m.step) and (m.waiting if op == m.admit else m.running):
            op(rng.randrange(8), rng.randint(1, 12))
        elif op == m.preempt and m.running or op == m.abort and (m.running or m.waiting):
            op(rng.randrange(8))
        elif op == m.reset_prefix_cache:
            op()
        m.consistent()
    m.teardown()
