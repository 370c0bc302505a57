"""The gates' report: verdicts, the table, JSON and JUnit XML, and the last commit at which a failing check passed."""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET

import pytest

from rtxcore.errors import ConfigError
from rtxcore.gates.outcome import FAIL, PASS, SKIP, Check, Report, read_baseline, skipped
from rtxcore.gates.thresholds import load_phase_tables, settings
from rtxcore.gates.throughput import ThroughputSettings


def _report(commit: str, ratio: float) -> Report:
    return Report("cpu", "cpu", commit, [Check("throughput", "engine / HF", ratio, 1.5, ">=", "raw numbers"),
                                         Check("security", "findings", 0, 0, "<="),
                                         skipped("quality", "ppl", "transformers is not installed")])


def test_verdicts_follow_the_comparison():
    assert Check("g", "c", 1.5, 1.5, ">=").verdict == PASS
    assert Check("g", "c", 1.49, 1.5, ">=").verdict == FAIL
    assert Check("g", "c", 1, 0, "<=").verdict == FAIL
    assert skipped("g", "c", "why").verdict == SKIP


def test_a_failing_check_names_the_last_commit_at_which_it_passed(tmp_path):
    good = _report("aaa111", 2.0)
    good.apply_baseline(None)
    (tmp_path / "good.json").write_text(json.dumps(good.to_json()))
    bad = _report("bbb222", 1.2)
    bad.apply_baseline(read_baseline(tmp_path / "good.json"))
    assert [c.last_passed_commit for c in bad.checks] == ["aaa111", "bbb222", None]
    assert "FAILED throughput: engine / HF: last passed at aaa111" in bad.table()
    # Still failing one commit later: the pass is carried forward from the failing report.
    (tmp_path / "bad.json").write_text(json.dumps(bad.to_json()))
    worse = _report("ccc333", 1.1)
    worse.apply_baseline(read_baseline(tmp_path / "bad.json"))
    assert worse.checks[0].last_passed_commit == "aaa111"


def test_json_and_junit_carry_every_check():
    report = _report("abc", 1.2)
    data = report.to_json()
    assert data["passed"] is False and [c["verdict"] for c in data["checks"]] == [FAIL, PASS, SKIP]
    root = ET.fromstring(report.junit())
    suites = {s.get("name"): s for s in root.iter("testsuite")}
    assert set(suites) == {"throughput", "security", "quality"}
    assert suites["throughput"].get("failures") == "1" and suites["quality"].get("skipped") == "1"
    (failure,) = root.iter("failure")
    assert "1.2 >= 1.5 does not hold" in failure.get("message")


def test_machine_class_tables_override_and_bad_tables_are_named(tmp_path):
    tables = load_phase_tables()
    assert settings(ThroughputSettings, tables, "throughput", "gpu").num_requests == 256
    assert settings(ThroughputSettings, tables, "throughput", "cpu").num_requests == 64
    with pytest.raises(ConfigError, match=r"\[phase.throughput\] has unknown keys \['bogus'\]"):
        settings(ThroughputSettings, {"throughput": {**tables["throughput"], "bogus": 1}}, "throughput", "cpu")
    (tmp_path / "none.toml").write_text("[latency]\n")
    with pytest.raises(ConfigError, match="no \\[phase"):
        load_phase_tables(tmp_path / "none.toml")
    (tmp_path / "report.json").write_text("[1, 2]")
    with pytest.raises(ConfigError, match="not a JSON report"):
        read_baseline(tmp_path / "report.json")
