"""The pytest plugin: parametrizes the suite's tests over the registered plugins of each kind and collects results.

Standalone use (in a plugin's own CI, without the ``rtx`` command)::

    pytest -p rtx_conformance.plugin --pyargs rtx_conformance.suite --rtx-plugin my-policy [--rtx-gates]

``rtx plugins test`` runs the same suite in-process with a :class:`ConformanceSession` it builds itself.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from rtx_conformance.gates.config import GATE_NAMES, Gates, load_gates
from rtxcore.errors import PluginError
from rtxcore.registry import KINDS, ComponentRecord, PluginRegistry, load_plugins


@dataclass(frozen=True, slots=True)
class Selection:
    """Which components to test: by name (any kind), by kind, or all when both are empty."""

    names: tuple[str, ...] = ()
    kinds: tuple[str, ...] = ()

    def records(self, registry: PluginRegistry) -> list[ComponentRecord]:
        for kind in self.kinds:
            if kind not in KINDS:
                raise PluginError(f"unknown plugin kind {kind!r}; kinds are {', '.join(KINDS)}")
        records = [r for r in registry.records() if not self.kinds or r.kind in self.kinds]
        if self.names:
            known = {r.name for r in records}
            missing = [n for n in self.names if n not in known]
            if missing:
                scope = f" of kind {', '.join(self.kinds)}" if self.kinds else ""
                raise PluginError(f"no plugin{scope} named {', '.join(map(repr, missing))} is registered "
                                  f"(available: {', '.join(sorted(known)) or 'none'})")
            records = [r for r in records if r.name in self.names]
        return records


@dataclass(slots=True)
class CheckResult:
    kind: str
    name: str
    # The test's name without its parameters, e.g. "test_token_budget_property"; a gate's is its gate name.
    check: str
    gate: str | None
    outcome: str  # "passed", "failed" or "skipped"
    message: str = ""
    duration_s: float = 0.0
    figures: dict[str, Any] = field(default_factory=dict)


# eq=False keeps it hashable: pytest's plugin manager keys plugins by object.
@dataclass(slots=True, eq=False)
class ConformanceSession:
    registry: PluginRegistry
    records: list[ComponentRecord]
    run_gates: bool
    gates: Gates
    results: list[CheckResult] = field(default_factory=list)
    # Collected test id -> (component, test function name).
    _items: dict[str, tuple[ComponentRecord, str]] = field(default_factory=dict)

    def records_of(self, kinds: Iterable[str]) -> list[ComponentRecord]:
        kinds = set(kinds)
        return [r for r in self.records if r.kind in kinds]

    # -- pytest hooks ---------------------------------------------------------------------------------------------

    def pytest_configure(self, config: pytest.Config) -> None:
        config.addinivalue_line("markers", "rtx_kind(*kinds): the plugin kinds a conformance test applies to")
        config.addinivalue_line("markers", "rtx_gate(name): a conformance gate (runs with --gates only)")

    def pytest_generate_tests(self, metafunc: pytest.Metafunc) -> None:
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
            callspec = getattr(item, "callspec", None)
            # Kinds with nothing selected parametrize over an empty set, which pytest marks with a placeholder.
            unselected = callspec is None or not isinstance(callspec.params.get("component"), ComponentRecord)
            gated_off = item.get_closest_marker("rtx_gate") is not None and not self.run_gates
            (drop if unselected or gated_off else keep).append(item)
        if drop:
            config.hook.pytest_deselected(items=drop)
            items[:] = keep
        for item in keep:
            record = item.callspec.params["component"]
            self._items[item.nodeid] = (record, item.originalname)

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

    def _record(self, report: pytest.TestReport) -> None:
        if report.nodeid not in self._items:
            return
        record, check = self._items[report.nodeid]
        kind, name = record.kind, record.name
        gate = next((g for g in GATE_NAMES if check == f"test_gate_{g}"), None)
        if report.skipped:
            outcome, message = "skipped", _skip_reason(report)
        elif report.failed:
            outcome, message = "failed", _failure_message(report)
        else:
            outcome, message = "passed", ""
        self.results.append(CheckResult(kind, name, gate or check.removeprefix("test_"), gate, outcome, message,
                                        report.duration, dict(report.user_properties)))


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
    group.addoption("--rtx-gates-file", default=None, help="gate thresholds (default: spec/gates.toml)")


def pytest_configure(config: pytest.Config) -> None:
    if any(isinstance(p, ConformanceSession) for p in config.pluginmanager.get_plugins()):
        return
    registry = load_plugins()
    selection = Selection(tuple(config.getoption("rtx_plugin")), tuple(config.getoption("rtx_kind")))
    gates_file = config.getoption("rtx_gates_file")
    session = ConformanceSession(registry, selection.records(registry), config.getoption("rtx_gates"),
                                 load_gates(Path(gates_file) if gates_file else None))
    config.pluginmanager.register(session, "rtx-conformance-session")
