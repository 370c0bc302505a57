"""Run the suite in-process for a registry and a selection; what ``rtx plugins test`` calls."""

from __future__ import annotations

import contextlib
import io
import os
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path

import pytest

from rtx_conformance.check_timeout import DEFAULT_TIMEOUT_S
from rtx_conformance.gates.config import load_gates
from rtx_conformance.plugin import ConformanceSession, Selection
from rtx_conformance.rules import ContractViolation
from rtxcore.errors import PluginError
from rtxcore.registry import PluginRegistry

SUITE_DIR = Path(__file__).resolve().parent / "suite"
_VIOLATION_PREFIX = f"{ContractViolation.__module__}.{ContractViolation.__qualname__}: "


@dataclass(slots=True)
class SuiteRun:
    session: ConformanceSession
    # pytest's exit code: 0 all passed, 1 some failed, 5 nothing collected, other values an error of the run itself.
    exit_code: int
    # pytest's own output, for --verbose and for errors of the run itself.
    log: str

    @property
    def passed(self) -> bool:
        return self.exit_code == 0 and not any(r.outcome == "failed" for r in self.session.results)


def run_suite(registry: PluginRegistry, selection: Selection, *, gates: bool = False,
              gates_file: Path | None = None, junit_path: Path | None = None,
              timeout_s: float | None = DEFAULT_TIMEOUT_S) -> SuiteRun:
    """Every selected component's contract (and its gates), and a failed check for every plugin that failed to load
    which the selection answers for (:meth:`Selection.load_failures`). Each check's setup and call may each take
    ``timeout_s`` (None: no limit) before it fails.

    :raises PluginError: a selected name or kind matches nothing and no plugin failed to load (a usage error,
        reported before running).
    """
    session = ConformanceSession.for_selection(registry, selection, gates, load_gates(gates_file), timeout_s)
    if not session.records and not session.load_failures:
        raise PluginError("no plugin matches the selection")
    args = [str(SUITE_DIR), "-q", "-p", "no:cacheprovider", "-c", os.devnull, "--rootdir", str(SUITE_DIR),
            "-W", "ignore::DeprecationWarning"]
    if junit_path is not None:
        # xunit1 keeps each check's figures as <property> elements of its test case.
        args += ["--junitxml", str(junit_path), "-o", "junit_family=xunit1", "-o", "junit_suite_name=rtx-conformance"]
    log = io.StringIO()
    with contextlib.redirect_stdout(log):
        exit_code = int(pytest.main(args, plugins=[session]))
    if junit_path is not None and junit_path.exists():
        _rule_first(junit_path)
    return SuiteRun(session, exit_code, log.getvalue())


def _rule_first(junit_path: Path) -> None:
    """Failure messages in the JUnit report start with the rule's name, as in the table: pytest puts the exception's
    qualified class name first."""
    tree = ET.parse(junit_path)
    for failure in tree.iter():
        message = failure.get("message")
        if failure.tag in ("failure", "error") and message is not None:
            failure.set("message", message.removeprefix(_VIOLATION_PREFIX))
    tree.write(junit_path, encoding="utf-8", xml_declaration=True)
