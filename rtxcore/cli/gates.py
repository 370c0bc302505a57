"""``rtx gates``: run the phase gates on this machine against the default model; exit 1 when one fails."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from rtxcore.cli.common import output_dir, output_path
from rtxcore.gates import GATES


def add_parser(sub) -> None:
    p = sub.add_parser(
        "gates", help="run the phase gates (throughput, latency, cache, reliability, security, quality)",
        description="Run the seed's phase gates on this machine against the default model and print one table (gate, "
                    "figure, threshold, verdict). Thresholds: spec/gates.toml's [phase.*] tables, per machine class "
                    "(cpu, gpu). Exit 1 when a gate fails, 2 on bad input. docs/gates.md says what each measures.")
    p.add_argument("--only", action="append", choices=GATES, metavar="GATE",
                   help=f"run only this gate (repeat for several; one of {', '.join(GATES)}); default: all")
    p.add_argument("--gates-file", type=Path, default=None, help="thresholds (default: spec/gates.toml)")
    p.add_argument("--json", type=output_path, default=None, metavar="FILE", help="write the report as JSON")
    p.add_argument("--junit", type=output_path, default=None, metavar="FILE", help="write the report as JUnit XML")
    p.add_argument("--baseline", type=Path, default=None, metavar="FILE",
                   help="an earlier --json report: a failing check names the last commit at which it passed")
    p.add_argument("--workdir", type=output_dir, default=None, metavar="DIR",
                   help="keep the servers' logs and state here (default: a temporary directory)")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from rtxcore.gates.outcome import read_baseline
    from rtxcore.gates.runner import run_gates

    baseline = read_baseline(args.baseline) if args.baseline is not None else None

    def say(line: str) -> None:
        sys.stderr.write(f"rtx gates: {line}\n")
        sys.stderr.flush()

    report = run_gates(tuple(args.only or GATES), args.gates_file, args.workdir, say)
    report.apply_baseline(baseline)
    print(report.table())
    if args.json is not None:
        args.json.write_text(json.dumps(report.to_json(), indent=2) + "\n")
    if args.junit is not None:
        args.junit.write_text(report.junit() + "\n")
    return 1 if report.failed else 0
