"""The chart's alert rules (a PrometheusRule): valid for Prometheus (``promtool check rules``), and each alert fires
on the series that should raise it and stays quiet on those that should not (``promtool test rules``). promtool
comes from scripts/setup.sh (.tools/bin/promtool, out of Debian's prometheus package)."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest
import yaml

from tests.charts.test_helm_chart import HELM, one, render
from tests.helpers import REPO

PROMTOOL = REPO / ".tools" / "bin" / "promtool"
# The default render's selector: release "rtx" in namespace "serving", scraped through its -metrics Service.
SCRAPE = 'namespace="serving", service="rtx-rtx-serve-metrics", job="rtx-rtx-serve-metrics"'
SERIES = f'{SCRAPE}, pod="rtx-0", model="m"'


@pytest.fixture(scope="module")
def rules_file(tmp_path_factory) -> Path:
    if not HELM.is_file() or not PROMTOOL.is_file():
        pytest.fail(f"helm or promtool is missing under {HELM.parent}: run scripts/setup.sh")
    rule = one(render(HELM, "default"), "PrometheusRule")
    path = tmp_path_factory.mktemp("rules") / "rules.yaml"
    path.write_text(yaml.safe_dump({"groups": rule["spec"]["groups"]}))
    return path


def promtool(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(PROMTOOL), *args], capture_output=True, text=True, timeout=60, check=False)


def test_rules_are_valid_and_use_documented_metrics(rules_file):
    result = promtool("check", "rules", str(rules_file))
    assert result.returncode == 0, result.stdout + result.stderr
    rules = yaml.safe_load(rules_file.read_text())["groups"][0]["rules"]
    assert {r["alert"] for r in rules} == {"RtxServeLaneTTFTOverTarget", "RtxServeLaneITLOverTarget",
                                           "RtxServeBrownoutActive", "RtxServeKVCachePressure", "RtxServeReplicaDown",
                                           "RtxServeOutOfMemory"}
    documented = set(re.findall(r"`(rtx_[a-z0-9_]+)`", (REPO / "docs" / "metrics.md").read_text()))
    used = {re.sub(r"_bucket$", "", m) for r in rules for m in re.findall(r"\brtx_[a-z0-9_]+", r["expr"])}
    assert used <= documented, used - documented
    assert all(r["labels"]["severity"] in ("warning", "critical") and r["annotations"]["summary"] for r in rules)


def _annotations(rule: dict, labels: dict[str, str], value: str) -> dict[str, str]:
    """The rule's annotations as Prometheus renders them for an alert with ``labels`` and ``value`` (as formatted)."""
    def fill(text: str) -> str:
        text = re.sub(r"\{\{ \$labels\.(\w+) \}\}", lambda m: labels[m.group(1)], text)
        return re.sub(r"\{\{ \$value( \| \w+)? \}\}", value, text)
    return {key: fill(text) for key, text in rule["annotations"].items()}


def _alerts(rules: dict[str, dict], name: str, *fired: tuple[dict[str, str], str]) -> dict:
    """An alert_rule_test entry: ``name`` firing once per (labels, value as shown) in ``fired``, or not at all."""
    return {"alertname": name, "exp_alerts": [{"exp_labels": labels, "exp_annotations":
                                               _annotations(rules[name], labels, value)} for labels, value in fired]}


def test_each_alert_fires_when_it_should_and_only_then(rules_file, tmp_path):
    bucket = "rtx_lane_time_to_first_token_seconds_bucket"
    series = [
        # realtime: every first token between 0.1 and 1 s (p95 about 0.96 s) against a 0.2 s target: fires.
        # standard: the same latencies against 4 s: quiet.
        *({"series": f'{bucket}{{{SERIES}, lane="{lane}", le="{le}"}}', "values": values}
          for lane in ("realtime", "standard")
          for le, values in (("0.1", "0x30"), ("1", "0+10x30"), ("+Inf", "0+10x30"))),
        {"series": f'rtx_lane_target_seconds{{{SERIES}, lane="realtime", latency="ttft"}}', "values": "0.2x30"},
        {"series": f'rtx_lane_target_seconds{{{SERIES}, lane="standard", latency="ttft"}}', "values": "4x30"},
        # Brownout for 3 minutes (quiet: under 5m), then for 10 (fires).
        {"series": f"rtx_brownout_level{{{SERIES}}}", "values": "0 1 1 1 0 0 1x12"},
        # The device cache full and evicting: fires after 10 minutes; full but not evicting: quiet.
        {"series": f"rtx_kv_cache_usage_ratio{{{SERIES}}}", "values": "0.97x30"},
        {"series": f'rtx_kv_tier_pressure_ratio{{{SERIES}, tier="device"}}', "values": "0.95x30"},
        {"series": f'rtx_kv_cache_usage_ratio{{{SCRAPE}, pod="rtx-1", model="m"}}',
         "values": "0.99x30"},
        {"series": f'rtx_kv_tier_pressure_ratio{{{SCRAPE}, pod="rtx-1", model="m", '
                   'tier="device"}', "values": "0x30"},
        # One replica answers, the other stopped answering 5 minutes in.
        {"series": f"up{{{SERIES}}}", "values": "1x30"},
        {"series": f'up{{{SCRAPE}, pod="rtx-1"}}', "values": "1 1 1 1 1 0x25"},
        # One out-of-memory step at minute 12.
        {"series": f"rtx_oom_total{{{SERIES}}}", "values": "0x11 1x18"},
        # Another release's pods are not this chart's business.
        {"series": 'up{namespace="other", service="rtx-rtx-serve-metrics", pod="x"}', "values": "0x30"},
        # Nor are other services' pods in the same namespace.
        {"series": 'up{namespace="serving", service="something-else", pod="y"}', "values": "0x30"},
    ]
    rules = {r["alert"]: r for r in yaml.safe_load(rules_file.read_text())["groups"][0]["rules"]}
    pod0 = {"namespace": "serving", "service": "rtx-rtx-serve-metrics", "job": "rtx-rtx-serve-metrics",
            "pod": "rtx-0", "model": "m"}
    checks = [
        ("20m", _alerts(rules, "RtxServeLaneTTFTOverTarget", ({"lane": "realtime", "severity": "warning"}, "955ms"))),
        ("4m", _alerts(rules, "RtxServeBrownoutActive")),
        ("15m", _alerts(rules, "RtxServeBrownoutActive", ({"pod": "rtx-0", "severity": "warning"}, "1"))),
        ("15m", _alerts(rules, "RtxServeKVCachePressure", ({"pod": "rtx-0", "severity": "warning"}, "0.97"))),
        ("6m", _alerts(rules, "RtxServeReplicaDown")),
        ("8m", _alerts(rules, "RtxServeReplicaDown", ({"namespace": "serving", "service": "rtx-rtx-serve-metrics",
                                                       "job": "rtx-rtx-serve-metrics", "pod": "rtx-1",
                                                       "severity": "critical"}, "0"))),
        ("10m", _alerts(rules, "RtxServeOutOfMemory")),
        ("13m", _alerts(rules, "RtxServeOutOfMemory", ({**pod0, "severity": "warning"}, "1"))),
        ("28m", _alerts(rules, "RtxServeOutOfMemory")),
    ]
    tests = [{"interval": "1m", "input_series": series,
              "alert_rule_test": [{"eval_time": at, **check} for at, check in checks]}]
    unit = tmp_path / "alerts_test.yaml"
    unit.write_text(yaml.safe_dump({"rule_files": [str(rules_file)], "evaluation_interval": "1m", "tests": tests}))
    result = promtool("test", "rules", str(unit))
    assert result.returncode == 0, result.stdout + result.stderr
