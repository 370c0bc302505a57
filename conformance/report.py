"""Results per component: the table ``rtx plugins test`` prints and the JSON report."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any

from rtx_conformance.gates.config import GATE_NAMES
from rtx_conformance.plugin import CheckResult, ConformanceSession


@dataclass(slots=True)
class GateCell:
    # "pass", "fail", "skipped", "not run" (--gates not given) or "n/a" (the gate does not measure this kind).
    status: str
    reason: str = ""
    figures: dict[str, Any] = field(default_factory=dict)

    def text(self) -> str:
        figures = " ".join(f"{k}={v}" for k, v in self.figures.items())
        if self.status == "skipped":
            return f"skipped: {self.reason}"
        return f"{self.status} {figures}".strip()


@dataclass(slots=True)
class ComponentSummary:
    name: str
    kind: str
    package: str
    version: str
    num_checks: int
    failures: list[str]
    skips: list[str]
    gates: dict[str, GateCell]

    @property
    def contract(self) -> str:
        if self.failures:
            return "fail"
        return "pass" if self.num_checks > len(self.skips) else "skipped"

    @property
    def passed(self) -> bool:
        return not self.failures and all(g.status != "fail" for g in self.gates.values())


def summarize(session: ConformanceSession) -> list[ComponentSummary]:
    summaries = []
    for record in session.records:
        mine = [r for r in session.results if (r.kind, r.name) == (record.kind, record.name)]
        checks = [r for r in mine if r.gate is None]
        gates = {g: _gate_cell(session, record.kind, g, [r for r in mine if r.gate == g]) for g in GATE_NAMES}
        summaries.append(ComponentSummary(
            record.name, record.kind, record.package, record.version, len(checks),
            [f"{r.check}: {r.message}" for r in checks if r.outcome == "failed"],
            [f"{r.check}: {r.message}" for r in checks if r.outcome == "skipped"], gates))
    return summaries


def _gate_cell(session: ConformanceSession, kind: str, gate: str, results: list[CheckResult]) -> GateCell:
    if not session.gates.applies(gate, kind):
        return GateCell("n/a")
    if not results:
        return GateCell("not run")
    result = results[0]
    status = {"passed": "pass", "failed": "fail", "skipped": "skipped"}[result.outcome]
    return GateCell(status, result.message, result.figures)


def render_table(summaries: list[ComponentSummary]) -> str:
    header = ("PLUGIN", "KIND", "PACKAGE", "CONTRACT") + tuple(g.upper() for g in GATE_NAMES)
    rows = [header]
    for s in summaries:
        contract = f"{s.contract} ({s.num_checks - len(s.failures)}/{s.num_checks})"
        rows.append((s.name, s.kind, f"{s.package} {s.version}".strip(), contract)
                    + tuple(s.gates[g].text() for g in GATE_NAMES))
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]
    for s in summaries:
        for failure in s.failures:
            lines.append(f"FAILED {s.kind} {s.name}: {failure}")
        for gate, cell in s.gates.items():
            if cell.status == "fail":
                lines.append(f"FAILED {s.kind} {s.name} gate {gate}: {cell.reason}")
    return "\n".join(lines) + "\n"


def to_json(session: ConformanceSession, summaries: list[ComponentSummary], passed: bool) -> str:
    return json.dumps({
        "passed": passed,
        "gates_run": session.run_gates,
        "components": [
            {"name": s.name, "kind": s.kind, "package": s.package, "version": s.version, "contract": s.contract,
             "passed": s.passed, "failures": s.failures, "skips": s.skips,
             "gates": {g: asdict(cell) for g, cell in s.gates.items()}}
            for s in summaries
        ],
        "checks": [asdict(r) for r in session.results],
    }, indent=2, default=str)
