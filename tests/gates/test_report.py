"""The gates' report: verdicts, the table, JSON and JUnit XML, and the last commit at which a failing check passed."""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET

import pytest

from rtxcore.errors import ConfigError
from rtxcore.gates.cache import CacheSettings
from rtxcore.gates.online import LatencySettings
from rtxcore.gates.outcome import FAIL, PASS, SKIP, Check, Report, read_baseline, skipped
from rtxcore.gates.quality import QualitySettings
from rtxcore.gates.restart import ReliabilitySettings
from rtxcore.gates.security import SecuritySettings
from rtxcore.gates.thresholds import load_phase_tables, settings
from rtxcore.gates.throughput import ThroughputSettings
from rtxcore.spec_files import spec_path
from tests.helpers.cli import assert_one_line_error, run_in_process


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


SETTINGS = {"throughput": ThroughputSettings, "latency": LatencySettings, "cache": CacheSettings,
            "reliability": ReliabilitySettings, "security": SecuritySettings, "quality": QualitySettings}


@pytest.mark.parametrize("gate, key, value, message", [
    # Out of range: the gate failed (exit 1) or ran on nonsense.
    ("throughput", "num_requests", -5, "num_requests must be from 1 to 390,625 (for prompts of up to 256 tokens), "
                                       "got -5"),
    ("throughput", "num_requests", 10**9, "num_requests must be from 1 to 390,625"),
    ("throughput", "prompt_len", [256, 32], "prompt_len: a length range needs 1 <= low <= high"),
    ("throughput", "output_len", [16], "output_len must be [low, high], got [16]"),
    ("throughput", "min_ratio", 0, "min_ratio must be > 0, got 0"),
    ("latency", "capacity_clients", 0, "capacity_clients must be from 1 to 4,096, got 0"),
    ("latency", "lanes", {"standard": [1.0, 32, 16, 8, 8]}, "lanes.standard: a length range needs"),
    ("latency", "lanes", {"standard": [1.0, 32.5, 64, 8, 8]}, "lanes.standard must be [weight, prompt low"),
    ("latency", "targets", {"realtime": [2.0, 1.0]}, "targets has no lane standard"),
    ("latency", "targets", {"realtime": [2.0, 1.0], "standard": [6.0, -1.0], "bulk": [10.0, 3.0]},
     "targets.standard must be [ttft_s, itl_s], both > 0"),
    ("cache", "min_hit_rate", 1.5, "min_hit_rate must be from 0 to 1, got 1.5"),
    ("reliability", "num_conversations", 0, "num_conversations must be from 1 to 256, got 0"),
    ("reliability", "num_streams", 100_000, "num_streams must be from 1 to 256"),
    ("security", "max_findings", -1, "max_findings must be >= 0, got -1"),
    ("quality", "plan_eval_tokens", 1, "plan_eval_tokens must be >= 2, got 1"),
    # Of the wrong type, nan and inf included (TOML has both): the run started with them.
    ("latency", "load", float("nan"), "load must be a finite number, got nan"),
    ("reliability", "overload", float("inf"), "overload must be a finite number, got inf"),
    ("latency", "duration_s", "60", "duration_s must be a finite number, got '60'"),
    ("throughput", "num_requests", 1.5, "num_requests must be an integer, got 1.5"),
    ("security", "max_findings", True, "max_findings must be an integer, got True"),
    ("latency", "serve_args", ["--max-num-seqs", 16], "serve_args must be a list of strings"),
    ("latency", "lanes", {"bulk": "heavy"}, "lanes must be a table of lists of finite numbers"),
])
def test_a_bad_value_is_named_with_its_gate_and_key(gate, key, value, message):
    tables = load_phase_tables()
    table = tables[gate]
    # The cpu overrides merged in first, as they would put the good value back over the bad one.
    tables[gate] = {**{k: v for k, v in table.items() if k not in ("cpu", "gpu")}, **table.get("cpu", {}), key: value}
    with pytest.raises(ConfigError) as caught:
        settings(SETTINGS[gate], tables, gate, "cpu")
    assert str(caught.value).startswith(f"[phase.{gate}] for cpu: ") and message in str(caught.value), caught.value


@pytest.mark.parametrize("line, value, message", [
    ("num_requests = 64", "num_requests = -5", "[phase.throughput] for cpu: num_requests must be from 1 to"),
    ("load = 0.5", "load = nan", "[phase.latency] for cpu: load must be a finite number, got nan"),
])
def test_rtx_gates_refuses_a_bad_value_before_running_anything(tmp_path, line, value, message):
    text = spec_path("gates.toml").read_text()
    assert text.count(f"\n{line}\n") == 1
    gates_file = tmp_path / "gates.toml"
    gates_file.write_text(text.replace(f"\n{line}\n", f"\n{value}\n"))
    assert_one_line_error(run_in_process("gates", "--gates-file", str(gates_file)), message)
