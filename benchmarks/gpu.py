"""The whole GPU batch in one call: kernel tests, correctness checks and the published GPU figures.

    python3 benchmarks/gpu.py [STEP ...]                          (default: tests greedy w3 w1 cb w8b)
    python3 benchmarks/gpu.py --before DIR [--runs N] STEP ...    (A/B: DIR against this tree, alternately)

Runs on a machine with a CUDA GPU and its own torch/triton/transformers (shared/ENVIRONMENT.md, "The GPU machine").
It first installs what that machine lacks from wheels carried in .whl/ (pytest, gguf, grpcio-tools for the build)
into /tmp/site, then rtx-serve itself without touching its torch: in editable mode from this tree, or, in A/B mode,
each tree into its own site folder (`pip install --target`), run from a neutral folder, so that neither tree's
source can shadow the other's install. Results go to $OUT (default ./gpu-out): one log per step, the JSON each
benchmark writes and, in A/B mode, a table per step (ab_STEP.md and ab_STEP.json) with both trees' figures.

Only the standard library is used here: this script runs before anything is installed.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

# This script runs before rtx-serve is installed: its sibling modules are found beside it.
sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_ab import ab_markdown, ab_rows, ab_summary, run_order  # noqa: E402
from gpu_steps import DEFAULT_STEPS, MODEL_FILE, STEPS, Command, Step, Tree  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
WHEEL_SITE = Path("/tmp/site")
AB_SITES = Path("/tmp/rtx-ab")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    steps_help = "\n".join(f"  {s.name:8} {s.help}{' [A/B]' if s.ab else ''}" for s in STEPS.values())
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter,
                                epilog=f"steps:\n{steps_help}\n(default: {' '.join(DEFAULT_STEPS)})")
    p.add_argument("steps", nargs="*", metavar="STEP", help="steps to run, in order")
    p.add_argument("--before", type=Path, default=None,
                   help="A/B mode: a second source tree (e.g. made by `git worktree add DIR COMMIT` and carried as a "
                        "plain folder); each step runs on it and on this tree alternately")
    p.add_argument("--runs", type=int, default=2, help="A/B mode: runs of each step on each tree (default 2)")
    p.add_argument("--no-hf", action="store_true", help="skip the HF transformers baseline of w1, w3 and w8b")
    p.add_argument("--model-file", default=None, help="the default model's GGUF on this machine (step spec)")
    p.add_argument("--out", type=Path, default=Path(os.environ.get("OUT") or ROOT / "gpu-out"),
                   help="results folder (default: $OUT, else ./gpu-out)")
    args = p.parse_args(argv)
    args.steps = args.steps or list(DEFAULT_STEPS)
    unknown = [s for s in args.steps if s not in STEPS]
    if unknown:
        p.error(f"unknown step(s): {', '.join(unknown)}; known: {', '.join(STEPS)}")
    if args.runs < 1:
        p.error(f"--runs must be at least 1, got {args.runs}")
    if args.before is not None:
        if not (args.before / "pyproject.toml").is_file():
            p.error(f"--before {args.before}: not a source tree of rtx-serve (no pyproject.toml)")
        if args.before.resolve() == ROOT:
            p.error("--before names this very tree")
        not_ab = [s for s in args.steps if not STEPS[s].ab and s != "install"]
        if not_ab:
            p.error(f"step(s) {', '.join(not_ab)} cannot run in A/B mode; A/B steps: "
                    f"{', '.join(s.name for s in STEPS.values() if s.ab)}")
    return args


# ---- running ----

def sh(argv: list[str], log: Path | None = None, cwd: Path = ROOT, env: dict[str, str] | None = None) -> int:
    """Run argv, its output to the console and (appended) to log."""
    print("+ " + " ".join(argv), flush=True)
    if shutil.which(argv[0]) is None:
        print(f"{argv[0]}: not found", flush=True)
        return 127
    with subprocess.Popen(argv, cwd=cwd, env={**os.environ, **(env or {})}, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, bufsize=1) as proc:
        fh = open(log, "a") if log else None
        try:
            for line in proc.stdout:
                sys.stdout.write(line)
                if fh:
                    fh.write(line)
        finally:
            if fh:
                fh.close()
    return proc.returncode


def install_wheels(out: Path) -> None:
    wheels = sorted((ROOT / ".whl").glob("*.whl"))
    if wheels:
        rc = sh([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                 "--no-cache-dir", "--upgrade", "--target", str(WHEEL_SITE), *map(str, wheels)], out / "install.log")
        if rc:
            sys.exit(f"installing the wheels of .whl/ failed (see {out / 'install.log'})")
        os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(WHEEL_SITE), os.environ.get("PYTHONPATH")]))


def install_editable(out: Path) -> Tree:
    if sh([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "-e", str(ROOT)],
          out / "install.log"):
        sys.exit(f"installing rtx-serve failed (see {out / 'install.log'})")
    return Tree("after", ROOT, ROOT)


def install_into_site(label: str, root: Path, out: Path) -> Tree:
    """Build ``root`` and install it into a folder of its own; its commands run from a neutral folder with that
    folder first on PYTHONPATH, and the check below fails the call if anything else would be imported."""
    home = AB_SITES / label
    site = home / "site"
    shutil.rmtree(home, ignore_errors=True)
    shutil.rmtree(root / "build", ignore_errors=True)  # no stale modules from an earlier build of this tree
    (home / "run").mkdir(parents=True)
    log = out / f"install_{label}.log"
    if sh([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "--no-compile",
           "--target", str(site), str(root)], log):
        sys.exit(f"installing the {label} tree ({root}) failed (see {log})")
    env = {"PYTHONPATH": os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")])),
           # Each tree builds its C++ extensions in its own folder (they are cached by name only).
           "TORCH_EXTENSIONS_DIR": str(home / "torch_extensions")}
    tree = Tree(label, root, home / "run", env)
    check = subprocess.run([sys.executable, "-c", "import rtxcore, rtx_kernels, rtx_plugins; print(rtxcore.__file__)"],
                           cwd=tree.cwd, env={**os.environ, **env}, capture_output=True, text=True)
    if check.returncode or not check.stdout.strip().startswith(str(site)):
        sys.exit(f"the {label} tree does not import from its own install {site}: {check.stdout}{check.stderr}")
    print(f"{label}: {root} installed into {site}", flush=True)
    return tree


def run_step(step: Step, tree: Tree, out: Path, suffix: str, hf: bool) -> tuple[bool, list[Command]]:
    ok = True
    commands = step.commands(tree, out, suffix, hf)
    for c in commands:
        print(f"== {step.name} ({tree.label}{suffix}): {c.log}", flush=True)
        ok &= sh(c.argv, out / c.log, cwd=tree.cwd, env=tree.env) == 0
    return ok, commands


def run_ab(step: Step, trees: dict[str, Tree], out: Path, runs: int, hf: bool) -> bool:
    ok = True
    by_command: dict[str, list[tuple[str, int, dict]]] = {}
    commands_of: dict[str, str] = {}
    for run, label in run_order(runs):
        step_ok, commands = run_step(step, trees[label], out, f"_{label}_{run}", hf)
        ok &= step_ok
        for c in commands:
            if c.json_path and c.json_path.is_file():
                name = c.log.rsplit(f"_{label}_{run}", 1)[0]
                payload = json.loads(c.json_path.read_text())
                by_command.setdefault(name, []).append((label, run, payload))
                commands_of[name] = payload.get("command", " ".join(c.argv))
    tables = []
    for name, results in by_command.items():
        rows = ab_rows(results)
        tables.append(ab_markdown(name, commands_of[name], rows))
        (out / f"ab_{name}.json").write_text(json.dumps(
            {"step": step.name, "trees": {k: str(t.root) for k, t in trees.items()}, "rows": rows,
             **ab_summary(rows)}, indent=2))
    if tables:
        text = "\n".join(tables)
        (out / f"ab_{step.name}.md").write_text(text)
        print(text, flush=True)
    return ok


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    for step in ("real", "guided"):
        if step in args.steps and not args.model_file:
            raise SystemExit(f"step {step} needs --model-file: the default model's GGUF on this machine")
    if args.model_file:
        MODEL_FILE[:] = [args.model_file]
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    os.environ["PYTHONUNBUFFERED"] = "1"
    install_wheels(out)
    if args.before is None:
        trees = {"after": install_editable(out)}
    else:
        trees = {"before": install_into_site("before", args.before.resolve(), out),
                 "after": install_into_site("after", ROOT, out)}
    sh(["nvidia-smi", "--query-gpu=name,memory.total,driver_version,clocks.sm", "--format=csv"], out / "gpu.txt")
    ok = True
    for name in args.steps:
        step = STEPS[name]
        if args.before is None:
            ok &= run_step(step, trees["after"], out, "", not args.no_hf)[0]
        else:
            ok &= run_ab(step, trees, out, args.runs, not args.no_hf)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
