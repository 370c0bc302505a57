"""Proposer contract: answers of the right shape that leave requests alone, finish() for any request, and greedy
output unchanged by speculation."""

from __future__ import annotations

import pytest

from rtx_conformance.checks.proposer import (
    MAX_K,
    ProposeCase,
    greedy_reference,
    harness_engine,
    run_finish_case,
    run_greedy_with,
    run_propose_case,
)

pytestmark = pytest.mark.rtx_kind("proposer")

_PATTERN = (11, 12, 13, 14, 15) * 4

CASES = {
    "one-request-k1": ProposeCase((_PATTERN,), (False,), (False,), (1,)),
    # Prompts of 3 to 70 tokens (several KV blocks), one bringing a prediction, one asking for early exit, k from 1
    # to the most the engine asks.
    "batch": ProposeCase((_PATTERN, (7, 8, 9), tuple(range(100, 170)), tuple(range(200, 230))),
                         (False, False, False, True), (False, True, False, False), (1, 4, 7, MAX_K)),
}


@pytest.fixture(scope="session")
def proposer_engine(conformance):
    engine = harness_engine(conformance.registry)
    yield engine
    if engine.has_unfinished_requests():
        raise RuntimeError("a proposer check left requests in the harness engine")


@pytest.fixture(scope="session")
def reference(conformance):
    return greedy_reference(conformance.registry)


@pytest.mark.rtx_rules("proposer.builds", "proposer.output_shape", "proposer.request_unchanged",
                       "proposer.confidences", "proposer.finish")
@pytest.mark.parametrize("case", list(CASES.values()), ids=list(CASES))
def test_propose(component, conformance, proposer_engine, case, record_figures):
    num_proposed = run_propose_case(component, proposer_engine, conformance.registry, case)
    record_figures({"proposed": num_proposed})


@pytest.mark.rtx_rules("proposer.builds", "proposer.finish", "proposer.request_unchanged")
def test_finish(component, conformance, proposer_engine):
    run_finish_case(component, proposer_engine, conformance.registry)


@pytest.mark.rtx_rules("proposer.builds", "proposer.greedy_unchanged")
def test_greedy_unchanged(component, conformance, reference, record_figures):
    run = run_greedy_with(component, conformance.registry, reference)
    record_figures({"proposed": run.num_proposed, "acceptance_rate": round(run.acceptance_rate, 3),
                    "mean_accepted_length": round(run.mean_accepted_length, 2)})
