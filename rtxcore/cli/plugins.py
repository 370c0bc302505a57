"""``rtx plugins list``: what is installed, from which package, and what it can do (``rtx plugins test``: see
``plugins_conformance.py``; ``rtx plugins new``: ``plugins_scaffold.py``)."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from rtxcore.cli.plugins_conformance import add_test_parser
from rtxcore.cli.plugins_scaffold import add_new_parser
from rtxcore.registry import PluginRegistry, load_plugins

# The table's lines are cut to this many characters (--verbose gives everything).
WIDTH = 100


def add_parser(sub) -> None:
    p = sub.add_parser("plugins", help="list, test and create plugins")
    psub = p.add_subparsers(dest="plugins_command", required=True)
    ls = psub.add_parser("list", help="list every registered plugin component",
                         description="One line per component: kind, name, the package it comes from and whether it "
                                     f"can run here, cut to {WIDTH} characters.")
    ls.add_argument("--verbose", "-v", action="store_true",
                    help="also each component's plugin, capabilities and whole reason for being unavailable")
    ls.add_argument("--json", action="store_true", help="print JSON instead of a table")
    ls.set_defaults(run=run_list)
    add_test_parser(psub)
    add_new_parser(psub)


def run_list(args: argparse.Namespace) -> int:
    registry = load_plugins()
    rows = component_rows(registry)
    failures = [{"plugin": f.plugin, "package": f.package, "error": f.error} for f in registry.failures]
    if args.json:
        json.dump({"plugins": rows, "failures": failures}, sys.stdout, indent=2, default=str)
        sys.stdout.write("\n")
        return 0
    lines = table(rows)
    if args.verbose:
        lines = lines[:1] + [detail for row, line in zip(rows, lines[1:]) for detail in [line, *_details(row)]]
    lines += [f"FAILED  plugin {f['plugin']} ({f['package']}): {f['error']}" for f in failures]
    for line in lines:
        sys.stdout.write((line if args.verbose or len(line) <= WIDTH else line[:WIDTH - 3] + "...") + "\n")
    return 0


def component_rows(registry: PluginRegistry) -> list[dict[str, Any]]:
    """One row per registered component: where it comes from, whether it can run here, its capabilities."""
    rows = []
    for rec in registry.records():
        caps = rec.capabilities()
        if getattr(rec.cls, "greedy_only", False):  # a sampler's declaration, whatever its describe() says
            caps["greedy_only"] = True
        available = caps.pop("available", True)
        reason = caps.pop("unavailable_reason", None)
        rows.append({
            "name": rec.name, "kind": rec.kind, "plugin": rec.plugin, "package": rec.package,
            "version": rec.version, "available": available, "unavailable_reason": reason, "capabilities": caps,
        })
    return rows


def table(rows: list[dict[str, Any]]) -> list[str]:
    """A header and one line per component, the columns aligned (the last one, the status, may be long)."""
    table = [("KIND", "NAME", "PACKAGE", "STATUS")]
    for r in rows:
        status = "available" if r["available"] else f"unavailable: {r['unavailable_reason']}"
        if r["capabilities"].get("greedy_only"):
            status += " (greedy only: temperature, top-k, top-p, min-p and seed ignored)"
        table.append((r["kind"], r["name"], f"{r['package']} {r['version']}", status))
    widths = [max(len(row[i]) for row in table) for i in range(len(table[0]) - 1)]
    return ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)) + "  " + row[-1] for row in table]


def _details(row: dict[str, Any]) -> list[str]:
    """The indented lines under a component's line with --verbose."""
    lines = [f"    plugin: {row['plugin']}"]
    for key, value in row["capabilities"].items():
        if isinstance(value, (list, tuple)):
            value = ", ".join(str(v) for v in value) or "-"
        lines.append(f"    {key}: {value}")
    return lines
