"""The A/B tables of benchmarks/gpu.py: pure functions of the JSON `rtx bench --json` writes, for two source trees
run alternately on one machine (standard library only: they run before anything is installed)."""

from __future__ import annotations

import statistics


def ab_rows(runs: list[tuple[str, int, dict]]) -> list[dict]:
    """One row per (tree, run) from `rtx bench --json` payloads: the engine's figures and its baseline's."""
    rows = []
    for tree, run, payload in runs:
        ours, *rest = payload["results"]
        base = rest[0] if rest else None
        rows.append({"tree": tree, "run": run, "date": payload.get("date"), "machine": payload.get("machine"),
                     "tokens_per_s": ours["tokens_per_s"], "ms_per_token": ours["ms_per_token_per_request"],
                     "baseline": base["label"] if base else None,
                     "baseline_tokens_per_s": base["tokens_per_s"] if base else None,
                     "baseline_ms_per_token": base["ms_per_token_per_request"] if base else None,
                     "ratio_vs_baseline": payload.get("ratio_vs_baseline")})
    return rows


def ab_summary(rows: list[dict]) -> dict:
    """Medians per tree and after / before of the medians (tokens/s: above 1 is faster; ms/token: below 1)."""
    medians = {}
    for tree in ("before", "after"):
        mine = [r for r in rows if r["tree"] == tree]
        if mine:
            medians[tree] = {"runs": len(mine),
                             "tokens_per_s": statistics.median(r["tokens_per_s"] for r in mine),
                             "ms_per_token": statistics.median(r["ms_per_token"] for r in mine)}
    out = {"medians": medians}
    if len(medians) == 2:
        out["after_vs_before"] = {
            "tokens_per_s": medians["after"]["tokens_per_s"] / medians["before"]["tokens_per_s"],
            "ms_per_token": medians["after"]["ms_per_token"] / medians["before"]["ms_per_token"]}
    return out


def ab_markdown(title: str, command: str, rows: list[dict]) -> str:
    """A small markdown table: every run of both trees, then the medians and their ratio."""
    lines = [f"### {title}", "", f"Command (each tree): `{command}`", "",
             "| tree | run | date | output tok/s | ms/token/stream | baseline tok/s | vs baseline |",
             "|---|---:|---|---:|---:|---:|---:|"]
    for r in rows:
        base = f"{r['baseline_tokens_per_s']:,.1f}" if r["baseline_tokens_per_s"] is not None else "-"
        ratio = f"{r['ratio_vs_baseline']:.2f}x" if r["ratio_vs_baseline"] is not None else "-"
        lines.append(f"| {r['tree']} | {r['run']} | {r['date'] or '-'} | {r['tokens_per_s']:,.1f} | "
                     f"{r['ms_per_token']:.3f} | {base} | {ratio} |")
    summary = ab_summary(rows)
    lines.append("")
    for tree, m in summary["medians"].items():
        lines.append(f"- {tree}: median of {m['runs']}: {m['tokens_per_s']:,.1f} tok/s, "
                     f"{m['ms_per_token']:.3f} ms/token/stream")
    if "after_vs_before" in summary:
        ratio = summary["after_vs_before"]
        lines.append(f"- after / before: tokens/s {ratio['tokens_per_s']:.3f}x, "
                     f"ms/token {ratio['ms_per_token']:.3f}x")
    machines = sorted({r["machine"] for r in rows if r.get("machine")})
    if machines:
        lines.append(f"- machine: {'; '.join(machines)}")
    return "\n".join(lines) + "\n"


def run_order(runs: int) -> list[tuple[int, str]]:
    """(run, tree) in the order they run: odd runs before then after, even runs after then before, so that a
    drift of the machine over the call does not favour one tree."""
    order = []
    for run in range(1, runs + 1):
        trees = ("before", "after") if run % 2 else ("after", "before")
        order += [(run, tree) for tree in trees]
    return order
