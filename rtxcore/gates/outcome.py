"""What the gates found: one :class:`Check` per figure, and the report of a run as a table, JSON and JUnit XML.

A report also names, for each check, the last commit at which it passed: this run's commit when it passes, else
what a previous report given as ``--baseline`` says (its commit if the check passed there), so a regression points
at once to the range of commits that made it.
"""

from __future__ import annotations

import json
import subprocess
import time
import xml.etree.ElementTree as ET
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from rtxcore import __version__
from rtxcore.errors import ConfigError

PASS, FAIL, SKIP = "pass", "fail", "skip"


@dataclass(slots=True)
class Check:
    gate: str
    # What is measured, in a few words ("engine / HF eager tok/s").
    name: str
    figure: float | None
    threshold: float
    # "<=" or ">=": how the figure must compare with the threshold.
    op: str
    # Why it is skipped, or what else is worth knowing (the raw numbers behind a ratio).
    detail: str = ""
    skipped: bool = False
    last_passed_commit: str | None = None

    @property
    def verdict(self) -> str:
        if self.skipped or self.figure is None:
            return SKIP
        holds = self.figure <= self.threshold if self.op == "<=" else self.figure >= self.threshold
        return PASS if holds else FAIL

    @property
    def key(self) -> str:
        return f"{self.gate}: {self.name}"


def skipped(gate: str, name: str, reason: str) -> Check:
    return Check(gate, name, None, 0.0, "<=", reason, skipped=True)


def did_not_run(gate: str, name: str, exc: Exception) -> Check:
    """A failed check for work that raised instead of giving its figure."""
    return Check(gate, name, 0.0, 1.0, ">=", f"{type(exc).__name__}: {exc}")


@dataclass(slots=True)
class Report:
    machine: str
    device: str
    commit: str
    checks: list[Check] = field(default_factory=list)
    started_at: float = field(default_factory=time.time)
    elapsed_s: float = 0.0

    @property
    def failed(self) -> list[Check]:
        return [c for c in self.checks if c.verdict == FAIL]

    def apply_baseline(self, baseline: dict[str, Any] | None) -> None:
        """Fill each check's last passing commit from this run or from a previous report."""
        previous = {c["key"]: c for c in (baseline or {}).get("checks", [])}
        for check in self.checks:
            if check.verdict == PASS:
                check.last_passed_commit = self.commit
            elif check.key in previous:
                before = previous[check.key]
                check.last_passed_commit = (baseline or {}).get("commit") if before.get("verdict") == PASS \
                    else before.get("last_passed_commit")

    def table(self) -> str:
        rows = [("gate", "check", "figure", "threshold", "verdict")]
        for c in self.checks:
            figure = "-" if c.figure is None else f"{c.figure:.4g}"
            rows.append((c.gate, c.name, figure, f"{c.op} {c.threshold:g}", c.verdict.upper()))
        widths = [max(len(r[i]) for r in rows) for i in range(5)]
        lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]
        lines.insert(1, "  ".join("-" * w for w in widths))
        for c in self.checks:
            if c.verdict != PASS and c.detail:
                lines.append(f"{c.verdict}: {c.key}: {c.detail}")
        for c in self.failed:
            since = f"last passed at {c.last_passed_commit}" if c.last_passed_commit else \
                "no earlier pass on record (give --baseline REPORT.json)"
            lines.append(f"FAILED {c.key}: {since}")
        verdict = "FAILED" if self.failed else "passed"
        lines.append(f"rtx gates {verdict}: {sum(c.verdict == PASS for c in self.checks)} passed, {len(self.failed)} "
                     f"failed, {sum(c.verdict == SKIP for c in self.checks)} skipped in {self.elapsed_s:.0f} s "
                     f"({self.machine}: {self.device}, {self.commit})")
        return "\n".join(lines)

    def to_json(self) -> dict[str, Any]:
        return {"commit": self.commit, "machine": self.machine, "device": self.device,
                "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(self.started_at)),
                "elapsed_s": round(self.elapsed_s, 1), "passed": not self.failed,
                "checks": [{**asdict(c), "key": c.key, "verdict": c.verdict} for c in self.checks]}

    def junit(self) -> str:
        """One testsuite per gate, one testcase per check (failure or skipped with its detail)."""
        root = ET.Element("testsuites", name="rtx gates")
        for gate in dict.fromkeys(c.gate for c in self.checks):
            checks = [c for c in self.checks if c.gate == gate]
            suite = ET.SubElement(root, "testsuite", name=gate, tests=str(len(checks)),
                                  failures=str(sum(c.verdict == FAIL for c in checks)),
                                  skipped=str(sum(c.verdict == SKIP for c in checks)))
            for c in checks:
                case = ET.SubElement(suite, "testcase", classname=f"gates.{gate}", name=c.name)
                figure = "none" if c.figure is None else f"{c.figure:.6g}"
                message = f"{figure} {c.op} {c.threshold:g} does not hold. {c.detail}".strip()
                if c.verdict == FAIL:
                    ET.SubElement(case, "failure", message=message)
                elif c.verdict == SKIP:
                    ET.SubElement(case, "skipped", message=c.detail)
        return ET.tostring(root, encoding="unicode")


def read_baseline(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"baseline report not found: {path}") from None
    except (OSError, ValueError) as exc:
        raise ConfigError(f"baseline report {path} is not a JSON report of rtx gates: {exc}") from None
    if not isinstance(data, dict) or not isinstance(data.get("checks"), list):
        raise ConfigError(f"baseline report {path} is not a JSON report of rtx gates (no checks list)")
    return data


def current_commit() -> str:
    """The checkout's commit (short), or the package version outside a git checkout."""
    try:
        result = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], capture_output=True, text=True,
                                timeout=10, cwd=Path(__file__).resolve().parent, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return f"rtx-serve {__version__}"
    return result.stdout.strip() if result.returncode == 0 else f"rtx-serve {__version__}"
