"""Run the ``rtx`` command as a user would, and check its one-line errors."""

from __future__ import annotations

import contextlib
import io
import os
import subprocess
import sys
from pathlib import Path

from rtxcore.cli.main import main

RTX = str(Path(sys.executable).parent / "rtx")


def rtx(*args: str, env: dict | None = None, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run([RTX, *args], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})})


def assert_one_line_error(proc: subprocess.CompletedProcess, fragment: str, after_progress: bool = False) -> None:
    """Exit status 2 and one line on stderr, the error naming ``fragment``: no progress line before it (the input is
    checked before any work starts), no traceback, no warning.

    :param after_progress: the input can only be judged once work has begun (a plugin's options, checked by the
        plugin as it starts, after the weights load): progress lines may come first, the error is the last line.
    """
    assert proc.returncode == 2, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert lines and "error" in lines[-1] and fragment in lines[-1], proc.stderr
    assert len(lines) == 1 or after_progress and not any("error" in line or "Traceback" in line
                                                         for line in lines[:-1]), proc.stderr


def run_in_process(*argv: str) -> subprocess.CompletedProcess:
    """``rtx ARGV`` in this process (no interpreter start per case), as a finished process for the error checks."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(list(argv))
        except SystemExit as exc:  # argparse's usage errors
            code = int(exc.code or 0)
    return subprocess.CompletedProcess(["rtx", *argv], code, out.getvalue(), err.getvalue())


def config_file(tmp_path: Path, text: str) -> str:
    """A ``rtx serve --config`` file holding ``text``."""
    path = tmp_path / "serve.toml"
    path.write_text(text)
    return str(path)


def assert_config_file_error(tmp_path: Path, text: str, fragment: str) -> None:
    """``rtx serve --config FILE`` with ``text`` in FILE fails in one line holding ``fragment`` (``{path}`` in it
    stands for the file's path)."""
    path = config_file(tmp_path, text)
    assert_one_line_error(run_in_process("serve", "--model", "dummy:tiny", "--config", path),
                          fragment.format(path=path))
