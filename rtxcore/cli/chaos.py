"""``rtx chaos``: the chaos drills (:mod:`rtxcore.chaos.drills`) against ``rtx serve`` on 127.0.0.1, one table of
what survived; exit 1 when a drill lost, duplicated or changed anything, or left the server unhealthy."""

from __future__ import annotations

import argparse
import json

from rtxcore.cli.common import output_path


def add_parser(sub) -> None:
    from rtxcore.chaos.drills import DRILLS

    p = sub.add_parser("chaos", help="inject faults into a live server under load and count what survives",
                       description="Run chaos drills: each starts `rtx serve` on 127.0.0.1 (dummy:tiny), puts it "
                                   "under a load of greedy streams, injects a fault and checks that no accepted "
                                   "request was lost or duplicated, every other request got the tokens of an "
                                   "undisturbed run, and the server serves again; it reports how long it was not "
                                   "ready. disk-full needs root (it mounts a small tmpfs); slow-fsync and "
                                   "kill-during-compaction need a C compiler (an LD_PRELOAD shim).")
    p.add_argument("drills", nargs="*", metavar="DRILL",
                   help=f"drills to run (default: all): {', '.join(DRILLS)}")
    p.add_argument("--long", action="store_true", help="more and longer requests (default: the short form CI runs)")
    p.add_argument("--json", type=output_path, default=None, metavar="FILE", help="also write the results as JSON")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from rtxcore.chaos.drills import DRILLS, run_drill
    from rtxcore.errors import ConfigError

    unknown = [name for name in args.drills if name not in DRILLS]
    if unknown:
        raise ConfigError(f"unknown drill {unknown[0]!r} (drills: {', '.join(DRILLS)})")
    names = args.drills or list(DRILLS)
    results = []
    print(f"{'DRILL':<24}{'ACCEPTED':>9}{'DONE':>6}{'FAILED*':>8}{'LOST':>6}{'DUP':>5}{'WRONG':>6}{'REFUSED':>8}"
          f"{'NOT READY':>11}  VERDICT")
    for name in names:
        result = run_drill(name, short=not args.long)
        results.append(result)
        verdict = f"skipped: {result.skipped}" if result.skipped else ("pass" if result.passed else "FAIL")
        print(f"{name:<24}{result.accepted:>9}{result.completed:>6}{result.failed_by_design:>8}{result.lost:>6}"
              f"{result.duplicated_events:>5}{result.wrong_tokens:>6}{result.refusals:>8}"
              f"{result.recovery_s:>10.2f}s  {verdict}", flush=True)
        for note in result.notes:
            print(f"{'':<24}{note}")
    print("FAILED*: failed as the fault intends (the faulty plugin's own requests); REFUSED: 429/503 before "
          "acceptance, sent again; NOT READY: time /ready was not 200 (a restart's included)")
    if args.json is not None:
        args.json.write_text(json.dumps([r.to_json() for r in results], indent=2) + "\n")
    return 1 if any(not r.passed and r.skipped is None for r in results) else 0

