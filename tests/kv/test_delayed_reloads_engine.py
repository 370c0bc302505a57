"""The whole engine with reloads that take several steps to arrive, as on a GPU's copy stream: requests whose prefix
is on the way stay out of the steps while others run, and every conversation still gets the tokens it gets from a
cache with room for everything (greedy, float32 on this CPU, where batch shape does not change a token).

On this CPU a reload lands in place before it returns, so the schedulers' and the KV-cache manager's handling of a
copy in flight (kept out, hold given up before a preemption, completed before the step that reads it) never runs
here otherwise; the H200 runs it for real (benchmarks/w4_tiers.py), where random weights in bf16 make its replies
too sensitive to batch shape to compare. ``DelayedCopies`` stands in for the copy stream only: the bytes it holds
are those the tier gave, and they land when the step count says so."""

from __future__ import annotations

import random

import pytest
import torch

from rtxcore.kv.tiers.evict_ahead import EvictAhead
from rtxcore.kv.tiers.offload import KVOffload, Reload
from rtxcore.sampling_params import SamplingParams
from tests.helpers.engines import make_engine

DELAY_STEPS = 3


class DelayedCopies(KVOffload):
    """A reload's bytes are read from their tier at once and land DELAY_STEPS steps later."""

    def start_counting(self) -> None:
        self.steps = 0
        self.due: dict[int, int] = {}  # id(reload) -> the step count at which it has arrived
        self.num_delayed = 0  # reloads that were still on the way when asked
        self.num_landed = 0

    def reload(self, keys, tiers, block_ids, fetched=None, started_s=None) -> Reload:
        rows = []
        for key, tier in zip(keys[:len(block_ids)], tiers):
            row = (fetched or {}).get(key)
            rows.append((tier.load(key) if row is None else row).clone())
        reload = Reload(list(keys), list(tiers), block_ids[:len(rows)], 0.0,
                        data=torch.stack(rows) if rows else None)
        self.stats.num_reloaded += len(rows)
        if not rows:
            self._release(reload)
        else:
            self.due[id(reload)] = self.steps + DELAY_STEPS
        return reload

    def arrived(self, reload: Reload) -> bool:
        if reload.done or self.steps >= self.due[id(reload)]:
            return True
        self.num_delayed += 1
        return False

    def complete(self, reload: Reload, block_ids=None) -> None:
        if reload.done:
            return
        assert self.steps >= self.due.pop(id(reload)), "a step would have read bytes still on the way"
        assert reload.data is not None
        keep = [i for i, b in enumerate(reload.block_ids) if block_ids is None or b in block_ids]
        if keep:
            self._write([reload.block_ids[i] for i in keep], reload.data[keep])
        self.num_landed += 1
        self._release(reload)

    def cancel(self, reload: Reload) -> None:
        self.due.pop(id(reload), None)
        super().cancel(reload)

    def end_step(self) -> None:
        self.steps += 1
        super().end_step()


def conversations(llm, num: int, turns: int, seed: int) -> list[list[int]]:
    """``num`` conversations turn by turn, all of a turn's requests together; every reply, in order."""
    rng = random.Random(seed)
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    histories: list[list[int]] = [[] for _ in range(num)]
    replies = []
    for _ in range(turns):
        prompts = [h + [rng.randrange(3, 500) for _ in range(20)] for h in histories]
        outputs = llm.generate(prompts, params)
        for h, prompt, out in zip(histories, prompts, outputs):
            h[:] = prompt + out.token_ids
            replies.append(out.token_ids)
    return replies


@pytest.mark.parametrize("scheduler", ["fcfs", "sla-lanes"])
def test_replies_with_reloads_on_the_way_equal_a_roomy_cache(scheduler, monkeypatch):
    settings = {"dtype": "float32", "scheduler": scheduler, "max_num_seqs": 6, "max_num_batched_tokens": 96}
    expected = conversations(make_engine(num_kv_blocks=256, **settings), num=8, turns=4, seed=0)

    # So few blocks that running requests run short while others hold prefixes on the way: those holds are given
    # up before anyone is preempted (counted here, the schedulers' own method doing the work).
    llm = make_engine(num_kv_blocks=28, kv_host_bytes=8 << 20, **settings)
    sched = llm.core.scheduler
    holds_dropped = []
    allocate_without_holds = sched._allocate_without_holds

    def counted(req, num_new):
        holds_dropped.append(sum(r is not req and r.num_computed_tokens > 0 for r in sched._holding))
        return allocate_without_holds(req, num_new)

    monkeypatch.setattr(sched, "_allocate_without_holds", counted)
    kv = llm.core.kv_cache
    offload = kv.offload
    assert offload is not None and kv._pending is not None
    offload.__class__ = DelayedCopies  # the same tiers, pool and bytes; only when the copies land changes
    offload.start_counting()
    # Evicting ahead runs on a GPU only; on here too, in batches of 4 once fewer than 4 blocks are empty.
    kv.evict_ahead = EvictAhead(kv.pool, batch=4)
    kv.evict_ahead.low = 4

    assert conversations(llm, num=8, turns=4, seed=0) == expected
    assert offload.num_landed > 0 and offload.num_delayed > 0, "no request waited for a reload"
    assert sum(holds_dropped) > 0, "no hold was given up"
    assert kv.evict_ahead.num_evicted > 0
    assert not offload.due and not kv._pending, "a reload was left on the way"
    kv.check_invariants()
    assert kv.num_free_blocks == kv.num_usable_blocks
