"""Results per component, counted by rule: the table ``rtx plugins test`` prints and the JSON report.

A test of the suite checks one or more rules (its ``rtx_rules`` marker, plus the kind's ``api`` rule). A rule has
*failed* when a failure names it, *passed* when a test covering it passed, is *not reached* when the tests covering
it stopped at another rule's failure first (it was never checked), and is *skipped* otherwise, with the skip reason
of the tests covering it.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from rtx_conformance.gates.config import GATE_NAMES
from rtx_conformance.plugin import CheckResult, ConformanceSession
from rtx_conformance.rules import RULES, rules_of

# A rule's outcomes, in the order the table counts them.
OUTCOMES = ("passed", "failed", "not reached", "skipped")


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
class RuleResult:
    rule: str
    outcome: str  # "passed", "failed", "skipped" or "not reached"
    # A failure's message (it starts with "[rule]"), or why the rule was skipped or not reached.
    message: str = ""


@dataclass(slots=True)
class ComponentSummary:
    name: str
    # The component's kind; "plugin" for a plugin that failed to load (name: its entry point).
    kind: str
    package: str
    version: str
    rules: list[RuleResult]
    gates: dict[str, GateCell]

    def count(self, outcome: str) -> int:
        return sum(1 for r in self.rules if r.outcome == outcome)

    @property
    def failures(self) -> list[str]:
        return [r.message for r in self.rules if r.outcome == "failed"]

    @property
    def skips(self) -> list[str]:
        return [f"{r.rule}: {r.message}" for r in self.rules if r.outcome == "skipped"]

    @property
    def unreached(self) -> list[str]:
        return [f"{r.rule}: {r.message}" for r in self.rules if r.outcome == "not reached"]

    @property
    def contract(self) -> str:
        if self.failures:
            return "fail"
        return "pass" if self.count("passed") else "skipped"

    @property
    def contract_text(self) -> str:
        """``pass (11/13 rules, 2 skipped)``: rules passed of the kind's rules, then those failed, not reached and
        skipped."""
        if self.kind == "plugin":
            return "fail (not loaded)"
        others = [f"{n} {outcome}" for outcome in OUTCOMES[1:] if (n := self.count(outcome))]
        return f"{self.contract} ({self.count('passed')}/{len(self.rules)} rules{''.join(', ' + o for o in others)})"

    @property
    def passed(self) -> bool:
        return not self.failures and all(g.status != "fail" for g in self.gates.values())


def summarize(session: ConformanceSession) -> list[ComponentSummary]:
    summaries = []
    for failure in session.load_failures:
        mine = [r for r in session.results if (r.kind, r.name) == ("plugin", failure.plugin)]
        summaries.append(ComponentSummary(failure.plugin, "plugin", failure.package, "",
                                          [_rule_result("plugin.loads", mine)],
                                          {g: GateCell("n/a") for g in GATE_NAMES}))
    for record in session.records:
        mine = [r for r in session.results if (r.kind, r.name) == (record.kind, record.name)]
        checks = [r for r in mine if r.gate is None]
        gates = {g: _gate_cell(session, record.kind, g, [r for r in mine if r.gate == g]) for g in GATE_NAMES}
        summaries.append(ComponentSummary(record.name, record.kind, record.package, record.version,
                                          [_rule_result(rule, checks) for rule in rules_of(record.kind)], gates))
    return summaries


def _rule_result(rule: str, checks: list[CheckResult]) -> RuleResult:
    broke = next((c for c in checks if c.outcome == "failed" and c.rule == rule), None)
    if broke is not None:
        return RuleResult(rule, "failed", broke.message)
    covering = [c for c in checks if rule in c.rules]
    if any(c.outcome == "passed" for c in covering):
        return RuleResult(rule, "passed")
    if rule.endswith(".builds") and any(c.outcome == "failed" and c.rule == rule.replace(".builds", ".api")
                                        for c in covering):
        # A check broke the api rule: a method of a component it had built raised or returned the wrong type.
        return RuleResult(rule, "passed")
    skipped = next((c for c in covering if c.outcome == "skipped"), None)
    if skipped is not None:
        return RuleResult(rule, "skipped", skipped.message)
    stopped = next((c for c in covering if c.outcome == "failed"), None)
    if stopped is not None:
        return RuleResult(rule, "not reached", f"check {stopped.check} stopped at {stopped.rule or 'an error'} first")
    return RuleResult(rule, "skipped", "no check of this rule ran")


def _gate_cell(session: ConformanceSession, kind: str, gate: str, results: list[CheckResult]) -> GateCell:
    if not session.gates.applies(gate, kind):
        return GateCell("n/a")
    if not results:
        return GateCell("not run")
    result = results[0]
    status = {"passed": "pass", "failed": "fail", "skipped": "skipped"}[result.outcome]
    return GateCell(status, result.message, result.figures)


def render_table(summaries: list[ComponentSummary], missing: Sequence[str] = ()) -> str:
    header = ("PLUGIN", "KIND", "PACKAGE", "CONTRACT") + tuple(g.upper() for g in GATE_NAMES)
    rows = [header]
    for s in summaries:
        rows.append((s.name, "-" if s.kind == "plugin" else s.kind, f"{s.package} {s.version}".strip(),
                     s.contract_text) + tuple(s.gates[g].text() for g in GATE_NAMES))
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]
    for s in summaries:
        where = f"plugin {s.name} ({s.package})" if s.kind == "plugin" else f"{s.kind} {s.name}"
        lines += [f"FAILED {where}: {message}" for message in s.failures]
        lines += [f"FAILED {where} gate {gate}: {cell.reason}" for gate, cell in s.gates.items()
                  if cell.status == "fail"]
    for s in summaries:
        lines += [f"NOT REACHED {s.kind} {s.name}: {rule}" for rule in s.unreached]
    for s in summaries:
        lines += [f"SKIPPED {s.kind} {s.name}: {skip}" for skip in s.skips]
    failed = {s.name for s in summaries if s.kind == "plugin"}
    lines += [f"NOT FOUND {name}: " + ("its plugin failed to load (above)" if name in failed else
                                      "no component of that name is registered; it may come from a plugin that "
                                      "failed to load (above)") for name in missing]
    return "\n".join(lines) + "\n"


def to_json(session: ConformanceSession, summaries: list[ComponentSummary], passed: bool) -> str:
    return json.dumps({
        "passed": passed,
        "gates_run": session.run_gates,
        "not_found": session.missing,
        "components": [
            {"name": s.name, "kind": s.kind, "package": s.package, "version": s.version, "loaded": s.kind != "plugin",
             "contract": s.contract, "passed": s.passed,
             "num_rules": {outcome.replace(" ", "_"): s.count(outcome) for outcome in OUTCOMES},
             "rules": [{**asdict(r), "description": RULES[r.rule]} for r in s.rules],
             "failures": s.failures, "not_reached": s.unreached, "skips": s.skips,
             "gates": {g: asdict(cell) for g, cell in s.gates.items()}}
            for s in summaries
        ],
        "checks": [asdict(r) for r in session.results],
    }, indent=2, default=str)
