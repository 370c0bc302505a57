"""``rtx plugins test``: run the conformance suite (and with ``--gates`` the gates) for installed plugins."""

from __future__ import annotations

import argparse
import importlib
import sys
from pathlib import Path

# check_timeout imports neither pytest nor hypothesis, which may be missing (see run_test).
from rtx_conformance.check_timeout import DEFAULT_TIMEOUT_S
from rtxcore.cli.common import finite_float, output_file
from rtxcore.errors import ConfigError
from rtxcore.registry import KINDS, load_plugins

REPORT_FILES = {"json": "rtx-conformance.json", "junit": "rtx-conformance.xml"}


def add_test_parser(psub) -> None:
    t = psub.add_parser("test", help="run the conformance suite for the named (or all) plugin components",
                        description="Each component's contract, rule by rule (and with --gates the gates that "
                                    "measure its kind). Exit code 1 when a rule or gate fails or a plugin failed to "
                                    "load, 2 on bad input.")
    t.add_argument("names", nargs="*", metavar="NAME", help="component names (default: every registered one)")
    t.add_argument("--kind", action="append", choices=list(KINDS), default=[],
                   help="only components of this kind (repeatable)")
    t.add_argument("--gates", action="store_true", help="also run the latency, cache and quality gates")
    t.add_argument("--report", choices=list(REPORT_FILES), default=None, help="also write a JSON or JUnit report")
    t.add_argument("--report-file", type=output_file, default=None,
                   help="where the report goes (default: rtx-conformance.json / .xml in the current directory)")
    t.add_argument("--gates-file", type=Path, default=None,
                   help="gate thresholds (default: the gates.toml rtx-serve ships, spec/gates.toml in a checkout)")
    t.add_argument("--timeout", type=_seconds, default=None, metavar="SECONDS",
                   help="each check fails when it runs longer than this, a plugin that hangs included (0: no "
                        f"limit; default {DEFAULT_TIMEOUT_S:g})")
    t.add_argument("--verbose", action="store_true", help="also print pytest's own output")
    t.set_defaults(run=run_test)


def _seconds(text: str) -> float:
    value = finite_float(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text!r} is negative")
    return value


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
    timeout_s = DEFAULT_TIMEOUT_S if args.timeout is None else args.timeout or None
    run = run_suite(registry, Selection(tuple(args.names), tuple(args.kind)), gates=args.gates,
                    gates_file=args.gates_file, junit_path=report_file if args.report == "junit" else None,
                    timeout_s=timeout_s)
    if args.verbose or run.exit_code not in (0, 1):
        sys.stderr.write(run.log)
    summaries = summarize(run.session)
    # A plugin that failed to load and a name not found fail the run as a broken rule does.
    passed = run.passed and all(s.passed for s in summaries) and not run.session.missing
    sys.stdout.write(render_table(summaries, run.session.missing))
    if report_file is not None and args.report == "json":
        report_file.write_text(to_json(run.session, summaries, passed) + "\n")
    if report_file is not None:
        sys.stdout.write(f"{args.report} report: {report_file}\n")
    # Failures of other packages than the components asked for: shown, but they are not this run's verdict.
    for failure in registry.failures:
        if failure not in run.session.load_failures:
            sys.stdout.write(f"NOT LOADED plugin {failure.plugin} ({failure.package}), not tested: "
                             f"{failure.error}\n")
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
