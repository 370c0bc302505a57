"""Authenticator contract: an example declared, built from its context; its accepted credentials prove their
tenants; refused ones and junk prove none, never with the secret in the reason; nothing presented is not a refusal;
only AuthenticationFailed escapes."""

from __future__ import annotations

import pytest

from rtx_conformance.checks.authenticator import (
    build_from,
    check_accepts,
    check_nothing_presented,
    check_refuses,
    example_of,
)
from rtx_conformance.rules import ContractViolation

pytestmark = pytest.mark.rtx_kind("authenticator")


@pytest.fixture
def example(component):
    """Every check but the example's own needs it: without one it is skipped, the one failure saying why."""
    try:
        return example_of(component.cls)
    except ContractViolation:
        pytest.skip("no usable example() to test with")


@pytest.mark.rtx_rules("authenticator.example")
def test_example(component):
    example_of(component.cls)


@pytest.mark.rtx_rules("authenticator.builds", "authenticator.api", "authenticator.accepts")
def test_accepts_its_examples(component, example, record_figures):
    accepted = check_accepts(build_from(component.cls, example), example)
    record_figures({"accepted": accepted})


@pytest.mark.rtx_rules("authenticator.builds", "authenticator.api", "authenticator.refuses",
                       "authenticator.reason_without_secret")
def test_refuses_junk_and_its_refused_examples(component, example, record_figures):
    refused = check_refuses(build_from(component.cls, example), example)
    record_figures({"refused": refused})


@pytest.mark.rtx_rules("authenticator.builds", "authenticator.api", "authenticator.nothing_presented")
def test_nothing_presented_is_not_its_kind(component, example):
    check_nothing_presented(build_from(component.cls, example))
