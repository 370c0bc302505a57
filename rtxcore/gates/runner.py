"""Run the phase gates asked for, in an order that keeps the run short: offline gates first, then the live server's
(latency, with the overload part of reliability on the same server), the restart drill, security and quality.

A gate that raises (a server that does not start, a timeout) is one failed check naming the error, and the other
gates still run."""

from __future__ import annotations

import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from rtxcore.gates import cache, online, quality, restart, security, throughput
from rtxcore.gates.outcome import Check, Report, current_commit, did_not_run
from rtxcore.gates.thresholds import load_phase_tables, machine_class, settings


def device_name() -> str:
    import torch

    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"


def run_gates(names: tuple[str, ...], gates_file: Path | None = None, workdir: Path | None = None,
              say: Callable[[str], None] = print) -> Report:
    """:raises ConfigError: a bad gates file (before anything runs)."""
    tables = load_phase_tables(gates_file)
    machine = machine_class()
    # Every table is read first, so a bad one is found before minutes of measuring.
    throughput_s = settings(throughput.ThroughputSettings, tables, "throughput", machine)
    latency_s = settings(online.LatencySettings, tables, "latency", machine)
    cache_s = settings(cache.CacheSettings, tables, "cache", machine)
    reliability_s = settings(restart.ReliabilitySettings, tables, "reliability", machine)
    security_s = settings(security.SecuritySettings, tables, "security", machine)
    quality_s = settings(quality.QualitySettings, tables, "quality", machine)
    report = Report(machine, device_name(), current_commit())
    start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="rtx-gates-") as tmp:
        work = workdir or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        overload = reliability_s if "reliability" in names else None
        steps: list[tuple[str, Callable[[], list[Check]]]] = [
            ("throughput", lambda: throughput.run(throughput_s, say)),
            ("cache", lambda: cache.run(cache_s, gates_file, say)),
            ("latency", lambda: online.run(latency_s, overload, work, say)),
            ("reliability", lambda: restart.run(reliability_s, work, say)),
            ("security", lambda: security.run(security_s, work, say)),
            ("quality", lambda: quality.run(quality_s, gates_file, say)),
        ]
        if "reliability" in names and "latency" not in names:  # the overload part runs on the latency gate's server
            steps.insert(2, ("reliability", lambda: online.run(latency_s, reliability_s, work, say)))
        for gate, step in steps:
            if gate not in names:
                continue
            began = time.monotonic()
            try:
                # The overload part needs the latency gate's server: asked for alone, only its checks are kept.
                report.checks += [c for c in step() if c.gate in names]
            except Exception as exc:  # one gate's failure to run fails that gate, not the run
                report.checks.append(did_not_run(gate, "ran to the end", exc))
            say(f"{gate}: done in {time.monotonic() - began:.0f} s")
    report.elapsed_s = time.monotonic() - start
    return report
