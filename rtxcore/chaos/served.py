"""Start ``rtx serve`` in a subprocess on 127.0.0.1, as a user would: for the chaos drills (which kill, stop and
restart it) and the tests of the HTTP and gRPC servers.

    server = start_server("--model", "dummy:tiny")      # waits for GET /ready
    httpx.get(server.base_url + "/health")
    server.stop()                                       # SIGTERM, graceful drain; returns the exit code

Ports are chosen by the server itself (``--port 0``, ``--grpc-port 0``) and read back from the line it prints once
listening, so parallel test runs never race for a port. gRPC is started unless ``--no-grpc`` is among the
arguments. The server's stdout and stderr are read by threads (so a chatty server never blocks on a full pipe) and
kept in :attr:`ServerProcess.stdout` / :attr:`ServerProcess.stderr`.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

RTX = str(Path(sys.executable).parent / "rtx")
_READY = re.compile(r"^rtx serve: https?://\S+ .*model=", re.MULTILINE)
_LISTENING = re.compile(r"^rtx serve: listening on (https?)://([^\s;]+?):(\d+)(?: \(grpc [^\s)]+:(\d+)\))?;")


class ServerError(RuntimeError):
    """The server exited or did not become ready in time; the message holds its output."""


@dataclass
class ServerProcess:
    proc: subprocess.Popen
    base_url: str
    # None when started with --no-grpc.
    grpc_port: int | None
    _stdout: list[str] = field(default_factory=list)
    _stderr: list[str] = field(default_factory=list)
    _readers: list[threading.Thread] = field(default_factory=list)

    @property
    def stdout(self) -> str:
        return "".join(self._stdout)

    @property
    def stderr(self) -> str:
        return "".join(self._stderr)

    @property
    def grpc_target(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    def ready_line(self) -> bool:
        """Whether the server has printed the line it prints once ready."""
        return bool(_READY.search(self.stdout))

    def wait_ready(self, timeout: float = 180.0) -> None:
        """Poll ``GET /ready`` until it answers 200 and the server has printed its ready line."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise ServerError(f"server exited with {self.proc.returncode} before it was ready\n{self.output()}")
            if http_status(self.base_url + "/ready") == 200 and _READY.search(self.stdout):
                return
            time.sleep(0.2)
        raise ServerError(f"server not ready after {timeout:.0f}s\n{self.output()}")

    def send_signal(self, sig: int = signal.SIGTERM) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 60.0) -> int:
        """Signal the server and wait for it to exit (killing it past ``timeout``); returns its exit code."""
        self.send_signal(sig)
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        for reader in self._readers:
            reader.join(5)
        return self.proc.returncode

    def output(self) -> str:
        return f"--- stdout ---\n{self.stdout}--- stderr ---\n{self.stderr[-20000:]}"

    def __enter__(self) -> ServerProcess:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def start_server(*extra_args: str, wait_ready: bool = True, ready_timeout: float = 180.0,
                 env: dict[str, str] | None = None) -> ServerProcess:
    """Start ``rtx serve --host 127.0.0.1 --port 0 [--grpc-port 0] *extra_args`` and wait until it listens (and,
    with ``wait_ready``, until ``/ready`` says 200)."""
    args = [RTX, "serve", "--host", "127.0.0.1", "--port", "0"]
    if "--no-grpc" not in extra_args and "--grpc-port" not in extra_args:
        args += ["--grpc-port", "0"]
    args += list(extra_args)
    full_env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "PYTHONUNBUFFERED": "1",
                **(env or {})}
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=full_env,
                            encoding="utf-8", errors="replace")
    stdout: list[str] = []
    stderr: list[str] = []
    listening = threading.Event()
    found: list[re.Match] = []

    def read(stream, sink: list[str], watch: bool) -> None:
        for line in stream:
            sink.append(line)
            if watch and not found and (match := _LISTENING.match(line)):
                found.append(match)
                listening.set()
        listening.set()  # the stream ended: the process is gone

    readers = [threading.Thread(target=read, args=(proc.stdout, stdout, True), daemon=True),
               threading.Thread(target=read, args=(proc.stderr, stderr, False), daemon=True)]
    for reader in readers:
        reader.start()
    listening.wait(ready_timeout)
    if not found:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        raise ServerError(f"server did not start listening (exit code {proc.returncode})\n"
                          f"--- stdout ---\n{''.join(stdout)}--- stderr ---\n{''.join(stderr)}")
    scheme, host, port, grpc_port = found[0].groups()
    server = ServerProcess(proc, f"{scheme}://{host}:{port}", int(grpc_port) if grpc_port else None, stdout, stderr,
                           readers)
    if wait_ready:
        try:
            server.wait_ready(ready_timeout)
        except ServerError:
            server.stop(signal.SIGKILL)
            raise
    return server


def http_status(url: str, timeout: float = 5.0) -> int | None:
    """Status of a GET, or None when nothing answered."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            return response.status
    except urllib.error.HTTPError as exc:
        return exc.code
    except (urllib.error.URLError, OSError):
        return None


def metric(server: ServerProcess, name: str) -> float:
    """Sum of a sample over its label sets (``name`` as exposed, e.g. ``rtx_request_aborts_total``)."""
    text = httpx.get(server.base_url + "/metrics").text
    return sum(s.value for family in text_string_to_metric_families(text) for s in family.samples if s.name == name)


def wait_for(condition, timeout: float = 20.0, interval: float = 0.1) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(interval)
    return condition()
