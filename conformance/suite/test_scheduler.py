"""Scheduler contract: budget, capacity, no drops or duplicates, preemption rules, every request finishes."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from rtx_conformance.checks.scheduler import SchedulerWorkload, WorkloadRequest, run_workload
from rtx_conformance.rules import RULES
from rtx_conformance.suite.budgets import QUICK
from rtxcore.contracts.scheduler import SchedulerConfig

# run_workload checks every rule of the contract after every step.
pytestmark = [pytest.mark.rtx_kind("scheduler"),
              pytest.mark.rtx_rules(*(rule for rule in RULES if rule.startswith("scheduler.")))]


def _requests(specs, shared_prefix: int = 0) -> tuple[WorkloadRequest, ...]:
    # Requests share a prefix so that lookup_prefix finds cached blocks and admission starts past 0.
    prefix = list(range(10, 10 + shared_prefix))
    return tuple(WorkloadRequest(tuple(prefix + [500 + i] * (n - shared_prefix)), m, arrival, abort)
                 for i, (n, m, arrival, abort) in enumerate(specs))


FIXED = {
    # More demand than KV space: the scheduler must preempt (or wait) and still finish everything.
    "tight-cache": SchedulerWorkload(SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=8), 10, 8,
                                     _requests([(30, 20, 0, None)] * 6, shared_prefix=16)),
    # Prompts far longer than the budget: chunked prefill next to decodes.
    "long-prompts": SchedulerWorkload(SchedulerConfig(max_num_batched_tokens=16, max_num_seqs=4), 64, 16,
                                      _requests([(120, 8, 0, None), (5, 30, 0, None), (90, 4, 3, None)])),
    # Without chunked prefill a prompt that fits the budget still runs whole; aborts on the way.
    "no-chunking": SchedulerWorkload(SchedulerConfig(max_num_batched_tokens=48, max_num_seqs=2,
                                                     enable_chunked_prefill=False), 40, 4,
                                     _requests([(40, 6, 0, None), (12, 10, 0, 3), (30, 5, 1, None),
                                                (8, 12, 2, 9)])),
}


@pytest.mark.parametrize("workload", list(FIXED.values()), ids=list(FIXED))
def test_fixed_workloads(component, workload, record_figures):
    run = run_workload(component.cls, workload)
    record_figures({"steps": run.num_steps, "preemptions": run.num_preemptions})


@st.composite
def workloads(draw) -> SchedulerWorkload:
    block_size = draw(st.sampled_from([4, 8, 16]))
    config = SchedulerConfig(max_num_batched_tokens=draw(st.integers(1, 96)), max_num_seqs=draw(st.integers(1, 6)),
                             enable_chunked_prefill=draw(st.booleans()))
    specs = draw(st.lists(st.tuples(st.integers(1, 60), st.integers(1, 12), st.integers(0, 6),
                                    st.one_of(st.none(), st.integers(0, 40))), min_size=1, max_size=8))
    if not config.enable_chunked_prefill:
        # Without chunking a sequence longer than the budget can never be (re)computed after a preemption: not a
        # fair workload.
        budget = config.max_num_batched_tokens = max(config.max_num_batched_tokens, 16)
        specs = [(max(1, min(n, budget // 2)), min(m, budget // 2), a, x) for n, m, a, x in specs]
    shared = draw(st.integers(0, min(n for n, *_ in specs)))
    requests = _requests(specs, shared_prefix=shared)
    need = max(-(-(len(r.prompt_token_ids) + r.max_tokens) // block_size) for r in requests)
    num_blocks = need + 1 + draw(st.integers(0, 3 * need))
    return SchedulerWorkload(config, num_blocks, block_size, requests)


@QUICK
@given(workload=workloads())
def test_random_workloads(component, workload):
    run_workload(component.cls, workload)
