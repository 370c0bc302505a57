"""The pytest plugin: parametrizes the suite's tests over the registered plugins of each kind and collects results.

Standalone use (in a plugin's own CI, without the ``rtx`` command)::

    pytest -p rtx_conformance.plugin --pyargs rtx_conformance.suite --rtx-plugin my-policy [--rtx-gates]

``rtx plugins test`` runs the same suite in-process with a :class:`ConformanceSession` it builds itself.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from rtx_conformance.check_timeout import DEFAULT_TIMEOUT_S, CheckTimedOut, time_limit
from rtx_conformance.gates.config import GATE_NAMES, Gates, load_gates
from rtx_conformance.rules import ContractViolation, describe_exception, kind_rule
from rtxcore.errors import PluginError
from rtxcore.registry import KINDS, ComponentRecord, PluginFailure, PluginRegistry, load_plugins


@dataclass(frozen=True, slots=True)
class Selection:
    """Which components to test: by name (any kind), by kind, or all when both are empty."""

    names: tuple[str, ...] = ()
    kinds: tuple[str, ...] = ()

    def records(self, registry: PluginRegistry) -> list[ComponentRecord]:
        """The selected components.

        :raises PluginError: an unknown kind; a name nothing registered, unless a plugin failed to load (it may be
            that one: the run then reports the failures instead).
        """
        for kind in self.kinds:
            if kind not in KINDS:
                raise PluginError(f"unknown plugin kind {kind!r}; kinds are {', '.join(KINDS)}")
        records = [r for r in registry.records() if not self.kinds or r.kind in self.kinds]
        missing = self.missing(registry)
        if missing and not registry.failures:
            scope = f" of kind {', '.join(self.kinds)}" if self.kinds else ""
            known = sorted({r.name for r in records})
            raise PluginError(f"no plugin{scope} named {', '.join(map(repr, missing))} is registered "
                              f"(available: {', '.join(known) or 'none'})")
        if self.names:
            records = [r for r in records if r.name in self.names]
        return records

    def missing(self, registry: PluginRegistry) -> list[str]:
        """Names asked for that no component of the selected kinds has."""
        known = {r.name for r in registry.records() if not self.kinds or r.kind in self.kinds}
        return [n for n in self.names if n not in known]

    def load_failures(self, registry: PluginRegistry, records: list[ComponentRecord]) -> list[PluginFailure]:
        """The plugins that failed to load which this selection answers for: every one when no name is given (a
        failed plugin may have been of any kind), else those named, those of a selected component's package, and
        every one when a name is missing (it may be among them)."""
        if not self.names or self.missing(registry):
            return list(registry.failures)
        packages = {r.package for r in records}
        return [f for f in registry.failures if f.plugin in self.names or f.package in packages]


@dataclass(slots=True)
class CheckResult:
    # The component's kind, or "plugin" for a plugin that failed to load (name: its entry point).
    kind: str
    name: str
    # The test's name without its parameters, e.g. "test_token_budget_property"; a gate's is its gate name.
    check: str
    gate: str | None
    outcome: str  # "passed", "failed" or "skipped"
    message: str = ""
    duration_s: float = 0.0
    figures: dict[str, Any] = field(default_factory=dict)
    # The rules the check covers (rtx_rules markers plus the kind's api rule); none for a gate.
    rules: tuple[str, ...] = ()
    # The rule a failure broke: the name its message starts with.
    rule: str | None = None


# eq=False keeps it hashable: pytest's plugin manager keys plugins by object.
@dataclass(slots=True, eq=False)
class ConformanceSession:
    registry: PluginRegistry
    records: list[ComponentRecord]
    run_gates: bool
    gates: Gates
    # Plugins that failed to load which the selection answers for (Selection.load_failures): each fails plugin.loads.
    load_failures: list[PluginFailure] = field(default_factory=list)
    # Names asked for that nothing registered (reported beside the load failures they may be among).
    missing: list[str] = field(default_factory=list)
    results: list[CheckResult] = field(default_factory=list)
    # Each check's setup and its call may each take this long (None: no limit); see check_timeout.
    timeout_s: float | None = None
    # Collected test id -> what it tests: (kind, name, test function name, rules covered, component class).
    _items: dict[str, tuple[str, str, str, tuple[str, ...], type | None]] = field(default_factory=dict)

    @classmethod
    def for_selection(cls, registry: PluginRegistry, selection: Selection, run_gates: bool,
                      gates: Gates, timeout_s: float | None = None) -> ConformanceSession:
        records = selection.records(registry)
        return cls(registry, records, run_gates, gates, selection.load_failures(registry, records),
                   selection.missing(registry), timeout_s=timeout_s)

    def records_of(self, kinds: Iterable[str]) -> list[ComponentRecord]:
        kinds = set(kinds)
        return [r for r in self.records if r.kind in kinds]

    # -- pytest hooks ---------------------------------------------------------------------------------------------

    def pytest_configure(self, config: pytest.Config) -> None:
        config.addinivalue_line("markers", "rtx_kind(*kinds): the plugin kinds a conformance test applies to")
        config.addinivalue_line("markers", "rtx_gate(name): a conformance gate (runs with --gates only)")
        config.addinivalue_line("markers", "rtx_rules(*rules): the contract rules a conformance test checks")

    def pytest_generate_tests(self, metafunc: pytest.Metafunc) -> None:
        if "load_failure" in metafunc.fixturenames:
            metafunc.parametrize("load_failure", self.load_failures,
                                 ids=[f"plugin:{f.plugin}" for f in self.load_failures])
        if "component" not in metafunc.fixturenames:
            return
        marker = metafunc.definition.get_closest_marker("rtx_kind")
        gate = metafunc.definition.get_closest_marker("rtx_gate")
        kinds = marker.args if marker else ()
        if gate is not None:
            kinds = getattr(self.gates, gate.args[0]).kinds
        records = self.records_of(kinds)
        metafunc.parametrize("component", records, ids=[f"{r.kind}:{r.name}" for r in records])

    def pytest_collection_modifyitems(self, config: pytest.Config, items: list[pytest.Item]) -> None:
        keep, drop = [], []
        for item in items:
            subject = _subject(item)
            gated_off = item.get_closest_marker("rtx_gate") is not None and not self.run_gates
            (drop if subject is None or gated_off else keep).append(item)
        if drop:
            config.hook.pytest_deselected(items=drop)
            items[:] = keep
        for item in keep:
            subject = _subject(item)
            check = getattr(item, "originalname", item.name)
            if isinstance(subject, ComponentRecord):
                rules: tuple[str, ...] = ()
                if item.get_closest_marker("rtx_gate") is None:
                    declared = [rule for mark in item.iter_markers("rtx_rules") for rule in mark.args]
                    rules = tuple(dict.fromkeys([*declared, kind_rule(subject.kind, "api")]))
                self._items[item.nodeid] = (subject.kind, subject.name, check, rules, subject.cls)
            elif isinstance(subject, PluginFailure):
                self._items[item.nodeid] = ("plugin", subject.plugin, check, ("plugin.loads",), None)

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_setup(self, item: pytest.Item):
        try:
            with time_limit(self.timeout_s, f"{_check_name(item)}'s setup"):
                return (yield)
        except ContractViolation:
            raise
        except (Exception, CheckTimedOut) as exc:
            raise self._violation(item, exc) from exc

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_call(self, item: pytest.Item):
        try:
            with time_limit(self.timeout_s, _check_name(item)):
                return (yield)
        except ContractViolation:
            raise
        except (Exception, CheckTimedOut) as exc:
            raise self._violation(item, exc) from exc

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        if report.when == "call" or (report.when == "setup" and not report.passed):
            self._record(report)

    @pytest.fixture(scope="session")
    def conformance(self) -> ConformanceSession:
        return self

    @pytest.fixture
    def record_figures(self, request: pytest.FixtureRequest):
        """Call with a dict of figures; they go to the reports (JSON, JUnit properties and the table)."""
        def record(figures: dict[str, Any]) -> None:
            for key, value in figures.items():
                request.node.user_properties.append((key, value))
        return record

    def _violation(self, item: pytest.Item, exc: BaseException) -> BaseException:
        """What escaped a check, as the rule it breaks: a ContractViolation inside a group (hypothesis reports
        several failures as one) as itself, anything else as the kind's api rule, saying where it was raised. A
        gate's exceptions and those of tests of no component stay as they are."""
        for inner in _leaves(exc):
            if isinstance(inner, ContractViolation):
                return inner
        subject = self._items.get(item.nodeid)
        if subject is None or subject[0] == "plugin" or item.get_closest_marker("rtx_gate") is not None:
            return exc
        kind, _, _, _, cls = subject
        inner = _leaves(exc)[0]
        violation = ContractViolation(kind_rule(kind, "api"), f"raised {describe_exception(inner, cls)}")
        violation.__notes__ = list(getattr(exc, "__notes__", []))
        return violation

    def _record(self, report: pytest.TestReport) -> None:
        if report.nodeid not in self._items:
            return
        kind, name, check, rules, _ = self._items[report.nodeid]
        gate = next((g for g in GATE_NAMES if check == f"test_gate_{g}"), None)
        rule = None
        if report.skipped:
            outcome, message = "skipped", _skip_reason(report)
        elif report.failed:
            outcome, message = "failed", _failure_message(report)
            named = re.match(r"\[([\w.]+)\]", message)
            rule = named.group(1) if named else None
        else:
            outcome, message = "passed", ""
        self.results.append(CheckResult(kind, name, gate or check.removeprefix("test_"), gate, outcome, message,
                                        report.duration, dict(report.user_properties), rules, rule))


def _subject(item: pytest.Item) -> ComponentRecord | PluginFailure | None:
    """The component (or failed plugin) a collected test is about; None for a kind with nothing selected, which
    pytest parametrizes with a placeholder."""
    callspec = getattr(item, "callspec", None)
    if callspec is None:
        return None
    subject = callspec.params.get("component", callspec.params.get("load_failure"))
    return subject if isinstance(subject, (ComponentRecord, PluginFailure)) else None


def _check_name(item: pytest.Item) -> str:
    return getattr(item, "originalname", item.name).removeprefix("test_")


def _leaves(exc: BaseException) -> list[BaseException]:
    """The exceptions inside (nested) exception groups, depth first; ``[exc]`` for any other."""
    if isinstance(exc, BaseExceptionGroup):
        return [leaf for inner in exc.exceptions for leaf in _leaves(inner)]
    return [exc]


def _skip_reason(report: pytest.TestReport) -> str:
    longrepr = report.longrepr
    if isinstance(longrepr, tuple) and len(longrepr) == 3:
        return str(longrepr[2]).removeprefix("Skipped: ")
    return str(longrepr)


def _failure_message(report: pytest.TestReport) -> str:
    crash = getattr(report.longrepr, "reprcrash", None)
    message = crash.message if crash is not None else str(report.longrepr)
    # Hypothesis appends the falsifying example after the error; the first line names the rule.
    first = message.splitlines()[0] if message else ""
    for prefix in ("rtx_conformance.rules.ContractViolation: ", "AssertionError: "):
        first = first.removeprefix(prefix)
    return first


# -- standalone pytest use: `pytest -p rtx_conformance.plugin` ---------------------------------------------------

def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("rtx", "rtx-serve plugin conformance")
    group.addoption("--rtx-plugin", action="append", default=[], help="component name to test (repeatable)")
    group.addoption("--rtx-kind", action="append", default=[], help="plugin kind to test (repeatable)")
    group.addoption("--rtx-gates", action="store_true", help="also run the latency, cache and quality gates")
    group.addoption("--rtx-gates-file", default=None,
                    help="gate thresholds (default: the gates.toml rtx-serve ships, spec/gates.toml in a checkout)")
    group.addoption("--rtx-timeout", type=float, default=DEFAULT_TIMEOUT_S,
                    help=f"seconds each check may take before it fails (0: no limit; default {DEFAULT_TIMEOUT_S:g})")


def pytest_configure(config: pytest.Config) -> None:
    if any(isinstance(p, ConformanceSession) for p in config.pluginmanager.get_plugins()):
        return
    registry = load_plugins()
    selection = Selection(tuple(config.getoption("rtx_plugin")), tuple(config.getoption("rtx_kind")))
    gates_file = config.getoption("rtx_gates_file")
    session = ConformanceSession.for_selection(registry, selection, config.getoption("rtx_gates"),
                                               load_gates(Path(gates_file) if gates_file else None),
                                               config.getoption("rtx_timeout") or None)
    config.pluginmanager.register(session, "rtx-conformance-session")
