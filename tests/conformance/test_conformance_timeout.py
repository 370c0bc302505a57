"""A plugin that hangs fails its kind's api rule after --timeout, naming its own line, and the run goes on: a
hanging plugin used to hang `rtx plugins test` with it."""

from __future__ import annotations

import signal
import time

import pytest

from rtx_conformance.check_timeout import time_limit
from rtx_conformance.plugin import Selection
from rtx_conformance.report import summarize
from rtx_conformance.rules import RULES
from rtx_conformance.runner import run_suite
from rtx_plugins.eviction.lru import LRUPolicy
from rtxcore.hookspecs import hookimpl
from rtxcore.registry import load_plugins
from tests.helpers.cli import assert_one_line_error, run_in_process


class HangingPolicy(LRUPolicy):
    def evict(self):
        time.sleep(3600)
        return super().evict()


class StubbornPolicy(LRUPolicy):
    """Swallows the first interruption (a bare except in a retry loop), then hangs again."""

    def evict(self):
        try:
            time.sleep(3600)
        except BaseException:  # noqa: B036 - the point of this plugin
            pass
        time.sleep(3600)


class Hanging:
    @hookimpl
    def register_eviction_policies(self, register):
        register("hanging", HangingPolicy)
        register("stubborn", StubbornPolicy)


def test_a_hanging_plugin_fails_the_api_rule_at_its_own_line_and_the_run_ends():
    registry = load_plugins(load_entrypoints=False, extra=[("hanging", Hanging())])
    # This test runs under pytest-timeout, whose own alarm must survive the suite's.
    handler, (outer_left, _) = signal.getsignal(signal.SIGALRM), signal.getitimer(signal.ITIMER_REAL)
    started = time.monotonic()
    run = run_suite(registry, Selection(("hanging", "stubborn")), timeout_s=0.5)
    elapsed = time.monotonic() - started
    summaries = {s.name: s for s in summarize(run.session)}
    hanging = summaries["hanging"]
    assert not hanging.passed and hanging.count("failed") == 1, hanging.rules
    [failure] = hanging.failures
    assert failure.startswith(f"[eviction.api] {RULES['eviction.api']}: raised CheckTimedOut: "), failure
    assert "did not finish within 0.5 s" in failure and "test_conformance_timeout.py:" in failure \
        and "in evict)" in failure, failure
    # The stubborn one is interrupted again (every 5 s), so the run still ends; its check names it.
    assert any("CheckTimedOut" in f for f in summaries["stubborn"].failures), summaries["stubborn"].rules
    # The run went on past the hang (the checks that never call evict() passed), and left nothing armed.
    assert hanging.count("passed") >= 1, hanging.rules
    assert signal.getsignal(signal.SIGALRM) is handler
    left = signal.getitimer(signal.ITIMER_REAL)[0]
    assert (left > 0) == (outer_left > 0) and left <= outer_left, (left, outer_left)
    # Each check that calls evict() stops at the limit: a few seconds in all, not an hour.
    assert elapsed < 120, elapsed


def test_the_timeout_option_is_checked():
    for bad, fragment in (("-1", "is negative"), ("nan", "is not a finite number"), ("soon", "is not a number")):
        assert_one_line_error(run_in_process("plugins", "test", "lru", "--timeout", bad), fragment)


def test_an_outer_alarm_that_comes_first_fires_through_its_own_handler():
    class OuterFired(Exception):
        pass

    calls = []

    def outer(signum, frame):
        calls.append(signum)
        raise OuterFired

    saved = signal.getitimer(signal.ITIMER_REAL)
    previous = signal.signal(signal.SIGALRM, outer)
    signal.setitimer(signal.ITIMER_REAL, 0.2)
    try:
        with pytest.raises(OuterFired), time_limit(30, "check x"):
            time.sleep(5)
        # Fired once: not armed again afterwards, to go off a second time in whatever runs next.
        assert signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0)
        time.sleep(0.05)
        assert len(calls) == 1
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        if saved[0] > 0:
            signal.setitimer(signal.ITIMER_REAL, *saved)
