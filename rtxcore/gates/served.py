"""``rtx serve`` in a subprocess for the gates that measure the server as users run it: its log kept in a file (the
security gate reads it), its time to ready measured, stopped by SIGTERM or killed with SIGKILL."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

from rtxcore.errors import RtxError

_LISTENING = re.compile(r"listening on http://[^\s:]+:(\d+)")


class ServedProcess:
    def __init__(self, args: list[str], log_path: Path, env: dict[str, str] | None = None,
                 timeout_s: float = 600.0):
        """Start ``rtx serve --host 127.0.0.1 --port 0 --no-grpc *args`` and wait until ``/ready`` answers 200.

        :raises RtxError: it exited, or was not ready within ``timeout_s``.
        """
        rtx = str(Path(sys.executable).with_name("rtx"))
        self.log_path = log_path
        self._log = log_path.open("a")
        # Where this process's lines start: a log may hold an earlier run's (the restart drill appends to one).
        self._log_start = self._log.tell()
        start = time.monotonic()
        self.proc = subprocess.Popen([rtx, "serve", "--host", "127.0.0.1", "--port", "0", "--no-grpc", *args],
                                     stdout=self._log, stderr=subprocess.STDOUT,
                                     env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})})
        self.base_url = self._wait_listening(start + timeout_s)
        self._wait_ready(start + timeout_s)
        self.ready_s = time.monotonic() - start

    def _wait_listening(self, deadline: float) -> str:
        while time.monotonic() < deadline:
            match = _LISTENING.search(self._own_log())
            if match:
                return f"http://127.0.0.1:{match.group(1)}"
            self._check_alive()
            time.sleep(0.1)
        raise self._failed("did not start listening in time")

    def _wait_ready(self, deadline: float) -> None:
        while time.monotonic() < deadline:
            self._check_alive()
            try:
                if httpx.get(self.base_url + "/ready", timeout=5, trust_env=False).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        raise self._failed("was not ready in time")

    def _check_alive(self) -> None:
        if self.proc.poll() is not None:
            raise self._failed(f"exited with code {self.proc.returncode}")

    def _failed(self, what: str) -> RtxError:
        self.kill()
        tail = self._own_log().strip().splitlines()[-5:]
        return RtxError(f"rtx serve {what}: " + " | ".join(tail))

    def _own_log(self) -> str:
        with self.log_path.open("rb") as f:
            f.seek(self._log_start)
            return f.read().decode(errors="replace")

    def metric(self, name: str) -> float:
        """Sum of the samples of ``name`` over its label sets."""
        from prometheus_client.parser import text_string_to_metric_families

        text = httpx.get(self.base_url + "/metrics", timeout=30, trust_env=False).text
        return sum(s.value for family in text_string_to_metric_families(text) for s in family.samples
                   if s.name == name)

    def stop(self) -> int:
        """SIGTERM, then SIGKILL after a minute; returns the exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        return self.proc.returncode

    def kill(self) -> None:
        """SIGKILL, as a crash: nothing is flushed or saved."""
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self._log.close()

    def __enter__(self) -> ServedProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
