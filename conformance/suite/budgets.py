"""Hypothesis settings of the suite: derandomized (a run is repeatable), no example database, budgets that keep
the whole suite on the built-ins to well under a minute on 2 cores. A failure is shrunk to its smallest example but
not explained (the explain phase reruns it many times over to annotate it, which costs a broken plugin's run more than
the rest of its checks)."""

from __future__ import annotations

from hypothesis import HealthCheck, Phase, settings

_COMMON = dict(deadline=None, derandomize=True, database=None,
               phases=[phase for phase in Phase if phase is not Phase.explain],
               suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])

QUICK = settings(max_examples=40, **_COMMON)
SLOW = settings(max_examples=12, **_COMMON)
