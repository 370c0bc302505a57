"""What this package's CI runs: the package is installed, rtx-serve sees it, and it passes the conformance suite
(and the cache gate, which its eviction policy is measured by)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

RTX = str(Path(sys.executable).parent / "rtx")
OURS = {("eviction_policy", "2q"), ("sampler", "typical")}


def rtx(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([RTX, *args], capture_output=True, text=True, timeout=600)


def test_rtx_lists_our_plugins():
    proc = rtx("plugins", "list", "--json")
    assert proc.returncode == 0, proc.stderr
    listed = {(p["kind"], p["name"]): p["package"] for p in json.loads(proc.stdout)["plugins"]}
    assert {key: listed.get(key) for key in OURS} == {key: "rtx-example-plugins" for key in OURS}


def test_conformance_suite_and_gates_pass(tmp_path):
    report = tmp_path / "conformance.json"
    proc = rtx("plugins", "test", "2q", "typical", "--gates", "--report", "json", "--report-file", str(report))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    data = json.loads(report.read_text())
    assert data["passed"] and {(c["kind"], c["name"]) for c in data["components"]} == OURS
