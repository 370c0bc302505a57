"""Run the ``rtx`` command as a user would, and check its one-line errors."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

RTX = str(Path(sys.executable).parent / "rtx")


def rtx(*args: str, env: dict | None = None, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run([RTX, *args], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})})


def assert_one_line_error(proc: subprocess.CompletedProcess, fragment: str) -> None:
    assert proc.returncode == 2, proc.stderr
    errors = [line for line in proc.stderr.splitlines() if "error" in line]
    assert len(errors) == 1, proc.stderr
    assert fragment in errors[0], proc.stderr
    assert "Traceback" not in proc.stderr
