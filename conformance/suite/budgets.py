"""Hypothesis settings of the suite: derandomized (a run is repeatable), no example database, budgets that keep
the whole suite on the built-ins to well under a minute on 2 cores."""

from __future__ import annotations

from hypothesis import HealthCheck, settings

_COMMON = dict(deadline=None, derandomize=True, database=None,
               suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])

QUICK = settings(max_examples=40, **_COMMON)
SLOW = settings(max_examples=12, **_COMMON)
