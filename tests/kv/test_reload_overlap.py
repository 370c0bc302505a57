"""A prefix coming back from a lower tier while the steps go on: the request that waits for it stays out of the
steps, keeps its hold and its place, and the requests behind it run meanwhile; once the bytes have arrived it runs
with them. On a GPU the copy runs on a stream of its own (checked on the H200 by test_kv_tiers' GPU tests and
benchmarks/w4_tiers.py); here a copy path that holds the bytes back until the test lets them land stands in for
a copy stream still busy, and the KV-cache manager and the real schedulers are what is checked."""

from __future__ import annotations

import time

import pytest
import torch

from rtx_plugins.schedulers.fcfs import FCFSScheduler
from rtx_plugins.schedulers.sla_lanes import SLALanesScheduler
from rtxcore.contracts import SchedulerConfig
from rtxcore.kv.manager import KVCacheManager
from rtxcore.kv.tiers.host import HostTier
from rtxcore.kv.tiers.offload import KVOffload, Reload
from rtxcore.request import RequestStatus
from tests.helpers.kv import POLICIES, make_request

BLOCK_SIZE = 4
NUM_BLOCKS = 12
WIDTH = 8  # bytes per block in this toy cache


class HeldCopies(KVOffload):
    """Reloads whose bytes land only when ``landed`` is set, as a copy stream that has not finished yet."""

    landed = False

    def reload(self, keys, tiers, block_ids, fetched=None, started_s=None) -> Reload:
        rows = [(fetched or {}).get(k, None) for k in keys[:len(block_ids)]]
        rows = [tier.load(k) if row is None else row for k, tier, row in zip(keys, tiers, rows)]
        reload = Reload(list(keys), list(tiers), block_ids[:len(rows)], time.perf_counter(),
                        data=torch.stack(rows) if rows else None)
        if not rows:
            self._release(reload)
        return reload

    def arrived(self, reload: Reload) -> bool:
        return reload.done or self.landed

    def complete(self, reload: Reload, block_ids=None) -> None:
        if reload.done:
            return
        assert self.landed, "a step would have read bytes that had not arrived"
        assert reload.data is not None
        keep = [i for i, b in enumerate(reload.block_ids) if block_ids is None or b in block_ids]
        self._write([reload.block_ids[i] for i in keep], reload.data[keep])
        self._release(reload)


def manager_with_host_tier() -> tuple[KVCacheManager, HeldCopies, torch.Tensor]:
    cache = torch.zeros(NUM_BLOCKS, WIDTH, dtype=torch.uint8)

    def write(ids, data):
        cache[ids] = data

    host = HostTier(16, WIDTH, POLICIES["lru"](16))
    offload = HeldCopies([host], lambda ids: cache[ids].clone(), write)
    kv = KVCacheManager(NUM_BLOCKS, BLOCK_SIZE, POLICIES["lru"](NUM_BLOCKS), True, offload)
    return kv, offload, cache


def make_scheduler(name: str, kv: KVCacheManager):
    config = SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=4)
    if name == "fcfs":
        return FCFSScheduler(config, kv)
    config.options = {"merge_window_s": 0.0}
    return SLALanesScheduler(config, kv)


def first_turn_pushed_out(s, kv: KVCacheManager, cache: torch.Tensor, history: list[int]) -> torch.Tensor:
    """A conversation's first turn (history + 1 token) runs and finishes, its full blocks stay cached; a long
    request then pushes them out of the device into the host tier. Returns the bytes those blocks had."""
    first = make_request(history + [9])
    expected = run_once(s, kv, cache, first, lambda: cache[kv.block_ids(first.req_id)[:len(history) // BLOCK_SIZE]])
    run_once(s, kv, cache, make_request([20] * 44))
    return expected


def run_once(s, kv: KVCacheManager, cache: torch.Tensor, req, before_finish=None):
    """``req`` runs in one step and finishes, its full blocks left cached; returns ``before_finish()``'s copy."""
    s.add_request(req)
    computed(kv, cache, s.schedule())
    kept = before_finish().clone() if before_finish is not None else None
    req.status = RequestStatus.FINISHED_STOPPED
    s.finish_request(req)
    return kept


def computed(kv: KVCacheManager, cache: torch.Tensor, sched) -> None:
    """The step runs: each scheduled request's new blocks get bytes that name the request's first token and the
    block's position, so a reloaded block shows where it came from."""
    for req, n in zip(sched.scheduled, sched.num_scheduled_tokens):
        for i, block_id in enumerate(kv.block_ids(req.req_id)):
            if i * BLOCK_SIZE >= req.num_computed_tokens:
                cache[block_id] = (req.prompt_token_ids[0] * 8 + i) % 256
        req.num_computed_tokens += n


@pytest.mark.parametrize("scheduler", ["fcfs", "sla-lanes"])
def test_a_request_whose_prefix_is_on_the_way_lets_others_go_first(scheduler):
    kv, offload, cache = manager_with_host_tier()
    s = make_scheduler(scheduler, kv)
    history = [5] * 12  # 3 full blocks
    expected = first_turn_pushed_out(s, kv, cache, history)
    assert offload.stats.num_spilled >= 3

    # The second turn arrives, then a stranger: the turn's prefix starts back from the host tier.
    turn = make_request(history + [9, 7, 7])
    stranger = make_request([3] * 6)
    s.add_request(turn)
    s.add_request(stranger)
    out = s.schedule()
    assert out.scheduled == [stranger], "the request whose blocks are on the way ran, or held the queue"
    assert turn.status is RequestStatus.WAITING and turn.num_computed_tokens == 12
    kv.prepare_step(out.scheduled)  # does not touch the copy still on the way
    computed(kv, cache, out)
    kv.check_invariants()

    offload.landed = True
    out = s.schedule()
    assert turn in out.scheduled and out.num_scheduled_tokens[out.scheduled.index(turn)] == 3
    kv.prepare_step(out.scheduled)
    assert torch.equal(cache[kv.block_ids(turn.req_id)[:3]], expected)
    kv.check_invariants()


def test_a_request_leaving_while_its_prefix_is_on_the_way_leaves_nothing_behind():
    kv, offload, cache = manager_with_host_tier()
    s = make_scheduler("fcfs", kv)
    history = [5] * 12
    first_turn_pushed_out(s, kv, cache, history)

    turn = make_request(history + [9, 7])
    s.add_request(turn)
    assert s.schedule().is_empty
    host = offload.top
    pinned = [k for k in host.keys() if host._pins[host._slot_of[k]]]
    assert pinned, "the reload holds its source blocks"
    turn.status = RequestStatus.FINISHED_ABORTED
    s.finish_request(turn)
    kv.check_invariants()
    assert not any(host._pins), "the cancelled reload still pins blocks in the host tier"
    # Nothing of the abandoned copy stayed in the device's prefix cache: the same prefix comes back again.
    again = make_request(history + [9, 7])
    s.add_request(again)
    assert s.schedule().is_empty and again.num_computed_tokens == 12
    offload.landed = True
    assert s.schedule().scheduled == [again]


@pytest.mark.parametrize("scheduler", ["fcfs", "sla-lanes"])
def test_prefixes_start_back_for_no_more_requests_than_can_run_next(scheduler):
    """Requests waiting for their prefix hold device blocks for it: a schedule starts copies for at most as many
    requests as there are places to run, so that a queue of returning conversations cannot fill the pool with
    blocks that nobody can run on (each later admission failing, releasing its hold and copying again)."""
    kv, offload, cache = manager_with_host_tier()
    s = make_scheduler(scheduler, kv)  # 4 places
    histories = [[10 + n] * 4 for n in range(6)]  # one full block each
    for history in histories:
        run_once(s, kv, cache, make_request(history + [9]))
    run_once(s, kv, cache, make_request([20] * 40))
    assert all(kv.pool.lookup(key) is None for key in offload.top.keys()), "the histories left the device"

    turns = [make_request(history + [9, 7]) for history in histories]
    for turn in turns:
        s.add_request(turn)
    assert s.schedule().is_empty
    waiting = [t for t in turns if t.num_computed_tokens]
    assert len(waiting) == 4, "copies started for more requests than can run next"
    kv.check_invariants()
    offload.landed = True
    out = s.schedule()
    assert set(waiting) <= set(out.scheduled)


@pytest.mark.parametrize("scheduler", ["fcfs", "sla-lanes"])
def test_a_running_request_short_of_blocks_takes_them_from_a_prefix_on_the_way(scheduler):
    """A request whose prefix is coming back holds the pool's last blocks while a running request needs one more:
    the hold gives way (nothing was computed on it; the lookup is redone later) rather than the running request
    being preempted behind it, which left fcfs with a queue head that could never fit and a hold never reached."""
    kv, offload, cache = manager_with_host_tier()
    s = make_scheduler(scheduler, kv)
    history = [5] * 36  # 9 full blocks
    run_once(s, kv, cache, make_request(history + [9]))
    run_once(s, kv, cache, make_request([20] * 40))  # 10 blocks of 11: the history goes to the host tier
    runner = make_request([30] * 5)
    s.add_request(runner)
    computed(kv, cache, s.schedule())
    turn = make_request(history + [9, 7])
    s.add_request(turn)
    out = s.schedule()  # the runner decodes; the turn's 9 blocks start back and fill the pool
    assert turn.num_computed_tokens == 36 and kv.pool.num_free_blocks == 0
    for step in range(8):  # the runner crosses two block boundaries, with the copy still on the way
        computed(kv, cache, out)
        runner.all_token_ids.append(1)
        out = s.schedule()
        assert runner in out.scheduled, f"the running request lost its place at step {step}"
        assert not out.preempted
    kv.check_invariants()
    offload.landed = True
    computed(kv, cache, out)
    runner.status = RequestStatus.FINISHED_STOPPED
    s.finish_request(runner)
    out = s.schedule()
    out = out if turn in out.scheduled else s.schedule()
    assert turn in out.scheduled
