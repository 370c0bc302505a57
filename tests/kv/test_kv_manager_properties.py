"""KVCacheManager under random workloads (hypothesis state machines): no leaks, hits hold the right tokens."""

from __future__ import annotations

import random
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from rtxcore.request import Request
from tests.helpers.kv import make_manager, make_request

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
        req.num_computed_tokens = self.kv.lookup_prefix(req)
        if pick % 4:  # as the built-in schedulers do; a scheduler that never asks is correct too
            deadline = time.monotonic() + 30
            while not self.kv.ready(req):  # blocks read from a lower tier on worker threads
                assert time.monotonic() < deadline, "a lower tier's reads never came in"
                time.sleep(0.001)
        num_hit = req.num_computed_tokens
        assert num_hit % self.block_size == 0 and 0 <= num_hit < req.num_tokens
        for i, block_id in enumerate(self.kv.block_ids(req.req_id)):
            expected = req.all_token_ids[i * self.block_size:(i + 1) * self.block_size]
            assert self.content[block_id] == expected and self.salt_of[block_id] == req.cache_salt
        if self._allocate_and_compute(req, min(chunk, req.num_tokens - num_hit)):
            self.waiting.remove(req)
            self.running.append(req)
        else:
            self.kv.free(req)  # drop the lookup's hold; admission is retried later
            req.num_computed_tokens = 0

    @precondition(lambda self: self.running)
    @rule(pick=st.integers(0, 7), chunk=st.integers(1, 12))
    def step(self, pick, chunk):
        self.kv.prepare_step(self.running)  # as the engine before each step (collects lower tiers' reads that ended)
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
