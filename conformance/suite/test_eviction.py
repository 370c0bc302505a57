"""Eviction-policy contract: only candidates are evicted, only when asked, the policy's count of candidates follows the
pool's calls, and metadata stays bounded."""

from __future__ import annotations

import random

import pytest
from hypothesis import given
from hypothesis import strategies as st

from rtx_conformance.checks.eviction import NUM_EVENTS, check_bounded_metadata, random_events, run_events
from rtx_conformance.rules import build
from rtx_conformance.suite.budgets import QUICK

pytestmark = [pytest.mark.rtx_kind("eviction_policy"), pytest.mark.rtx_rules("eviction.builds")]

_EVENT_RULES = ("eviction.only_candidates", "eviction.evicts_when_asked", "eviction.tracks_candidates")


@pytest.mark.rtx_rules(*_EVENT_RULES)
@QUICK
@given(capacity=st.integers(2, 24),
       events=st.lists(st.tuples(st.integers(0, NUM_EVENTS - 1), st.integers(0, 1 << 16)), max_size=200))
def test_random_events(component, capacity, events):
    run_events(build("eviction_policy", component.cls, capacity), events)


@pytest.mark.rtx_rules("eviction.bounded_metadata", *_EVENT_RULES)
def test_long_run_keeps_metadata_bounded(component, record_figures):
    capacity = 64
    policy = build("eviction_policy", component.cls, capacity)
    model = None
    entries = []
    for chunk in range(4):
        model = run_events(policy, random_events(random.Random(chunk), 5000), model)
        entries.append(check_bounded_metadata(policy, model, f"{(chunk + 1) * 5000} events"))
    record_figures({"metadata_entries": max(entries), "capacity": capacity})
