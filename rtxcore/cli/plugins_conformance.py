"""``rtx plugins test``: run the conformance suite (and with ``--gates`` the gates) for installed plugins."""

from __future__ import annotations

import argparse
import importlib
import sys
from pathlib import Path

from rtxcore.cli.common import output_file
from rtxcore.errors import ConfigError
from rtxcore.registry import KINDS, load_plugins

REPORT_FILES = {"json": "rtx-conformance.json", "junit": "rtx-conformance.xml"}


def add_test_parser(psub) -> None:
    t = psub.add_parser("test", help="run the conformance suite for the named (or all) plugin components")
    t.add_argument("names", nargs="*", metavar="NAME", help="component names (default: every registered one)")
    t.add_argument("--kind", action="append", choices=list(KINDS), default=[],
                   help="only components of this kind (repeatable)")
    t.add_argument("--gates", action="store_true", help="also run the latency, cache and quality gates")
    t.add_argument("--report", choices=list(REPORT_FILES), default=None, help="also write a JSON or JUnit report")
    t.add_argument("--report-file", type=output_file, default=None,
                   help="where the report goes (default: rtx-conformance.json / .xml in the current directory)")
    t.add_argument("--gates-file", type=Path, default=None, help="gate thresholds (default: spec/gates.toml)")
    t.add_argument("--verbose", action="store_true", help="also print pytest's own output")
    t.set_defaults(run=run_test)


def run_test(args: argparse.Namespace) -> int:
    # The suite runs under pytest and hypothesis, which only this command needs (the `conformance` extra).
    missing = [name for name in ("pytest", "hypothesis") if not _importable(name)]
    if missing:
        raise ConfigError(f"rtx plugins test needs {' and '.join(missing)}: pip install 'rtx-serve[conformance]'")
    from rtx_conformance.plugin import Selection
    from rtx_conformance.report import render_table, summarize, to_json
    from rtx_conformance.runner import run_suite

    if args.report_file is not None and args.report is None:
        raise ConfigError("--report-file needs --report json or --report junit")
    registry = load_plugins()
    report_file = (Path(args.report_file) if args.report_file else
                   Path(REPORT_FILES[args.report]) if args.report else None)
    run = run_suite(registry, Selection(tuple(args.names), tuple(args.kind)), gates=args.gates,
                    gates_file=args.gates_file, junit_path=report_file if args.report == "junit" else None)
    if args.verbose or run.exit_code not in (0, 1):
        sys.stderr.write(run.log)
    summaries = summarize(run.session)
    passed = run.passed and all(s.passed for s in summaries)
    sys.stdout.write(render_table(summaries))
    if report_file is not None and args.report == "json":
        report_file.write_text(to_json(run.session, summaries, passed) + "\n")
    if report_file is not None:
        sys.stdout.write(f"{args.report} report: {report_file}\n")
    for failure in registry.failures:
        sys.stdout.write(f"NOT LOADED plugin {failure.plugin} ({failure.package}): {failure.error}\n")
    if run.exit_code not in (0, 1):
        sys.stderr.write(f"rtx: error: the conformance run itself failed (pytest exit code {run.exit_code})\n")
        return 1
    return 0 if passed else 1


def _importable(name: str) -> bool:
    try:
        importlib.import_module(name)
    except ImportError:
        return False
    return True
