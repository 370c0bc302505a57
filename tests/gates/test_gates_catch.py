"""The gates catch what they are for: a build whose scheduler stalls fails the latency gate, one whose signature check
lets a tampered model through fails the security check, and bad input is exit 2 with one line.

A broken build is made by a ``sitecustomize`` module on ``PYTHONPATH``, which every Python process the gates start
(``rtx serve`` included) imports first."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from rtxcore.gates import security
from rtxcore.spec_files import spec_path

# Serial: a latency run, alone so that a test beside it does not slow the healthy phases.
pytestmark = [pytest.mark.model, pytest.mark.serial]
RTX = str(Path(sys.executable).with_name("rtx"))

STALLING_SCHEDULER = '''
import os
import time
from rtx_plugins.schedulers.sla_lanes.scheduler import SLALanesScheduler

_schedule, _last = SLALanesScheduler.schedule, [0.0]


def schedule(self):
    # Once the flag file exists (the load phase: the capacity measurement ran on a healthy build), every 12 s of wall
    # time the step loop stops for 10 s: requests wait, whatever the load.
    if os.path.exists(os.environ["RTX_TEST_STALL_FLAG"]) and time.monotonic() - _last[0] > 12.0:
        time.sleep(10.0)
        _last[0] = time.monotonic()
    return _schedule(self)


SLALanesScheduler.schedule = schedule
'''

NO_SIGNATURE_CHECK = '''
import rtxcore.provenance.signing as signing

signing.check_model_signature = lambda model_path, policy: None
'''


def broken_build(tmp_path: Path, code: str) -> dict[str, str]:
    site = tmp_path / "broken"
    site.mkdir()
    (site / "sitecustomize.py").write_text(code)
    return {"PYTHONPATH": str(site)}


def small_gates_file(tmp_path: Path) -> Path:
    """spec/gates.toml with a short latency run and targets that a stall of 10 s breaks (a healthy build's p99 at half
    capacity is well under them, and its admission control, which refuses what it predicts to miss them, admits the
    capacity phase's requests on a busy machine)."""
    text = spec_path("gates.toml").read_text()
    for key, value in (("duration_s", "30"), ("capacity_duration_s", "10"), ("capacity_clients", "4"),
                       ("lanes", "{ realtime = [0.3, 16, 32, 8, 16], standard = [0.5, 16, 48, 8, 16], "
                                 "bulk = [0.2, 32, 64, 8, 16] }")):
        text = re.sub(rf"^{key} = .*$", f"{key} = {value}", text, count=1, flags=re.MULTILINE)
    text = re.sub(r"^targets = \{ realtime = \[2.0, 1.0\].*$",
                  "targets = { realtime = [6.0, 4.0], standard = [8.0, 5.0], bulk = [12.0, 6.0] }", text,
                  flags=re.MULTILINE)
    path = tmp_path / "gates.toml"
    path.write_text(text)
    return path


def test_a_stalling_scheduler_fails_the_latency_gate(tmp_path):
    flag = tmp_path / "stall"
    env = {**os.environ, **broken_build(tmp_path, STALLING_SCHEDULER), "RTX_TEST_STALL_FLAG": str(flag)}
    report = tmp_path / "report.json"
    proc = subprocess.Popen([RTX, "gates", "--only", "latency", "--gates-file", str(small_gates_file(tmp_path)),
                             "--json", str(report)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env)
    assert proc.stderr is not None
    for line in proc.stderr:  # the gate says when the load phase starts
        if "x for" in line:
            flag.touch()
    stdout = proc.stdout.read() if proc.stdout is not None else ""
    assert proc.wait(600) == 1 and flag.exists(), stdout
    failed = {c["name"] for c in json.loads(report.read_text())["checks"] if c["verdict"] == "fail"}
    assert failed & {"standard p99 TTFT / target", "standard p99 ITL / target", "realtime p99 TTFT / target"}, stdout
    assert "rtx gates FAILED" in stdout


def test_a_build_that_skips_the_signature_check_fails_the_security_gate(tmp_path, monkeypatch):
    (tmp_path / "good").mkdir()
    assert security._signing_findings(tmp_path / "good") == []  # the control: the real build refuses it
    monkeypatch.setenv("PYTHONPATH", broken_build(tmp_path, NO_SIGNATURE_CHECK)["PYTHONPATH"])
    (tmp_path / "bad").mkdir()
    (finding,) = security._signing_findings(tmp_path / "bad")
    assert finding.startswith("the tampered model was not refused")


@pytest.mark.parametrize("args, message", [
    (["--gates-file", "/nonexistent/gates.toml"], "gates file not found"),
    (["--baseline", "/nonexistent/report.json"], "baseline report not found"),
    (["--only", "speed"], "invalid choice: 'speed'"),
])
def test_bad_input_is_exit_2_with_one_line(args, message):
    result = subprocess.run([RTX, "gates", *args], capture_output=True, text=True, timeout=120, check=False)
    assert result.returncode == 2 and message in result.stderr and "Traceback" not in result.stderr
