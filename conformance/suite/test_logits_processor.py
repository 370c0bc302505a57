"""Logits-processor contract: example arguments declared and prepared, wrong ones refused with ValueError; apply()
changes its rows only, leaves something to sample, does not advance a state and scores rows after proposed tokens
as generated; forced tokens are ones it allows; states advance by the processor's own choices, resume from output
tokens, stay independent and finish; greedy requests through the engine keep to the processor."""

from __future__ import annotations

import pytest

from rtx_conformance.checks.logits_processor import (
    check_advance,
    check_apply,
    check_apply_pure,
    check_engine,
    check_finish,
    check_forced_tokens,
    check_independent_states,
    check_prepare,
    check_proposed_rows,
    check_resume,
)
from rtx_conformance.checks.logits_processor_harness import Harness, Models, build, example_args
from rtx_conformance.rules import ContractViolation

pytestmark = pytest.mark.rtx_kind("logits_processor")


@pytest.fixture(scope="session")
def logits_models(conformance) -> Models:
    return Models(conformance.registry)


@pytest.fixture
def declared(component) -> None:
    """Every check but example_args needs the examples: without them it is skipped, the one failure saying why."""
    try:
        example_args(component)
    except ContractViolation:
        pytest.skip("no example_args to test with")


@pytest.fixture
def harness(component, declared, logits_models) -> Harness:
    return logits_models.harness(component)


@pytest.mark.rtx_rules("logits_processor.example_args")
def test_example_args(component):
    example_args(component)


@pytest.mark.rtx_rules("logits_processor.builds")
def test_builds(component, declared, logits_models):
    build(component, logits_models.context(logits_models.needs_tokenizer(component)))


@pytest.mark.rtx_rules("logits_processor.builds", "logits_processor.prepare")
def test_prepare(harness):
    check_prepare(harness)


@pytest.mark.rtx_rules("logits_processor.builds", "logits_processor.rows_only", "logits_processor.valid_logits")
def test_apply(harness):
    check_apply(harness)


@pytest.mark.rtx_rules("logits_processor.builds", "logits_processor.apply_pure")
def test_apply_pure(harness):
    check_apply_pure(harness)


@pytest.mark.rtx_rules("logits_processor.builds", "logits_processor.proposed_rows")
def test_proposed_rows(harness):
    check_proposed_rows(harness)


@pytest.mark.rtx_rules("logits_processor.builds", "logits_processor.forced_tokens")
def test_forced_tokens(harness):
    check_forced_tokens(harness)


@pytest.mark.rtx_rules("logits_processor.builds", "logits_processor.advance")
def test_advance(harness, record_figures):
    tokens = check_advance(harness)
    record_figures({"walked_tokens": sum(len(t) for t in tokens)})


@pytest.mark.rtx_rules("logits_processor.builds", "logits_processor.resume")
def test_resume(harness):
    check_resume(harness)


@pytest.mark.rtx_rules("logits_processor.builds", "logits_processor.independent_states")
def test_independent_states(harness):
    check_independent_states(harness)


@pytest.mark.rtx_rules("logits_processor.builds", "logits_processor.finish")
def test_finish(harness):
    check_finish(harness)


@pytest.mark.rtx_rules("logits_processor.builds", "logits_processor.engine")
def test_engine(harness, logits_models, record_figures):
    run = check_engine(harness, logits_models)
    record_figures({"generated_tokens": run.num_tokens})
