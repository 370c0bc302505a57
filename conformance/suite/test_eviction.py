"""Eviction-policy contract: only candidates are evicted, only when asked, with bounded metadata."""

from __future__ import annotations

import random

import pytest
from hypothesis import given
from hypothesis import strategies as st

from rtx_conformance.checks.eviction import NUM_EVENTS, check_bounded_metadata, random_events, run_events
from rtx_conformance.suite.budgets import QUICK

pytestmark = pytest.mark.rtx_kind("eviction_policy")


@QUICK
@given(capacity=st.integers(2, 24),
       events=st.lists(st.tuples(st.integers(0, NUM_EVENTS - 1), st.integers(0, 1 << 16)), max_size=200))
def test_random_events(component, capacity, events):
    run_events(component.cls(capacity), events)


def test_long_run_keeps_metadata_bounded(component, record_figures):
    capacity = 64
    policy = component.cls(capacity)
    model = None
    entries = []
    for chunk in range(4):
        model = run_events(policy, random_events(random.Random(chunk), 5000), model)
        entries.append(check_bounded_metadata(policy, model, f"{(chunk + 1) * 5000} events"))
    record_figures({"metadata_entries": max(entries), "capacity": capacity})
