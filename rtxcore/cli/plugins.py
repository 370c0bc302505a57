"""``rtx plugins list``: what is installed, from which package, and what it can do (``rtx plugins test``: see
``plugins_conformance.py``)."""

from __future__ import annotations

import argparse
import json
import sys

from rtxcore.cli.plugins_conformance import add_test_parser
from rtxcore.registry import load_plugins


def add_parser(sub) -> None:
    p = sub.add_parser("plugins", help="inspect installed plugins")
    psub = p.add_subparsers(dest="plugins_command", required=True)
    ls = psub.add_parser("list", help="list every registered plugin component")
    ls.add_argument("--json", action="store_true", help="print JSON instead of a table")
    ls.set_defaults(run=run_list)
    add_test_parser(psub)


def run_list(args: argparse.Namespace) -> int:
    registry = load_plugins()
    rows = []
    for rec in registry.records():
        caps = rec.capabilities()
        available = caps.pop("available", True)
        reason = caps.pop("unavailable_reason", None)
        rows.append({
            "name": rec.name, "kind": rec.kind, "plugin": rec.plugin, "package": rec.package,
            "version": rec.version, "available": available, "unavailable_reason": reason, "capabilities": caps,
        })
    failures = [{"plugin": f.plugin, "package": f.package, "error": f.error} for f in registry.failures]
    if args.json:
        json.dump({"plugins": rows, "failures": failures}, sys.stdout, indent=2, default=str)
        sys.stdout.write("\n")
        return 0
    table = [("NAME", "KIND", "PACKAGE", "VERSION", "STATUS", "CAPABILITIES")]
    for r in rows:
        status = "available" if r["available"] else f"unavailable: {r['unavailable_reason']}"
        table.append((r["name"], r["kind"], r["package"], r["version"], status, _summarize(r["capabilities"])))
    widths = [max(len(row[i]) for row in table) for i in range(len(table[0]) - 1)]
    for row in table:
        sys.stdout.write("  ".join(cell.ljust(w) for cell, w in zip(row, widths)) + "  " + row[-1] + "\n")
    for f in failures:
        sys.stdout.write(f"FAILED  plugin {f['plugin']} ({f['package']}): {f['error']}\n")
    return 0


def _summarize(caps: dict) -> str:
    parts = []
    for key, value in caps.items():
        if isinstance(value, (list, tuple)):
            value = ",".join(str(v) for v in value) or "-"
        parts.append(f"{key}={value}")
    return " ".join(parts)
