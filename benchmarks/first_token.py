"""How soon the CLI answers: `rtx --help`, `rtx --version`, and a second `rtx generate` of the default model from
process start to its first token on stdout, beside `python -c "import torch"` (what any torch program pays first).

    python benchmarks/first_token.py [--runs 5]

Each figure is the median of ``--runs`` fresh processes, after one untimed `rtx generate` that builds whatever a
first run builds (the CPU kernel, if set-up did not). Prints a markdown table for docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import time

PROMPT = "The capital of France is"


def first_output_s(command: list[str]) -> tuple[float, float]:
    """Seconds from starting ``command`` to its first byte on stdout, and to its exit."""
    start = time.perf_counter()
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert proc.stdout is not None
    proc.stdout.read(1)
    first = time.perf_counter() - start
    proc.stdout.read()
    if proc.wait() != 0:
        raise SystemExit(f"{' '.join(command)} exited with {proc.returncode}")
    return first, time.perf_counter() - start


def median(command: list[str], runs: int, which: int) -> float:
    return statistics.median(first_output_s(command)[which] for _ in range(runs))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()
    rtx = shutil.which("rtx") or sys.exit("rtx is not on PATH: activate the environment first")
    generate = [rtx, "generate", PROMPT, "--max-tokens", "16", "--temperature", "0"]
    first_output_s(generate)  # the first run: builds what a first run builds
    rows = [
        ("`python -c \"import torch\"` (baseline)", median([sys.executable, "-c", "import torch; print(1)"],
                                                          args.runs, 0)),
        ("`rtx --version`", median([rtx, "--version"], args.runs, 1)),
        ("`rtx --help`", median([rtx, "--help"], args.runs, 1)),
        ("second `rtx generate` to its first token", median(generate, args.runs, 0)),
        ("second `rtx generate` to exit (16 tokens)", median(generate, args.runs, 1)),
    ]
    print(f"| command (median of {args.runs} processes) | seconds |\n|---|---:|")
    for name, seconds in rows:
        print(f"| {name} | {seconds:.2f} |")


if __name__ == "__main__":
    main()
