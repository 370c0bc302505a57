"""What every chaos drill shares: its result (the counts), its context (where, how long), and the helpers that run
a load through a fault and tally it against an undisturbed run (:mod:`rtxcore.chaos.drills` lists the drills)."""

from __future__ import annotations

import contextlib
import shutil
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx

from rtxcore.chaos.load import Stream, Target, duplicated_events, missing_events, reference_tokens
from rtxcore.chaos.served import ServerProcess, start_server, wait_for

MODEL_ARGS = ("--model", "dummy:tiny", "--no-grpc")


@dataclass
class DrillResult:
    name: str
    # Requests the server acknowledged (a 200 and a request id).
    accepted: int = 0
    # Accepted requests that finished with every token, each once, equal to the undisturbed run.
    completed: int = 0
    # Accepted requests that ended with the error the fault is meant to cause (the failing plugin's own requests).
    failed_by_design: int = 0
    lost: int = 0
    duplicated_events: int = 0
    missing_events: int = 0
    wrong_tokens: int = 0
    # 429/503 answers before acceptance, sent again by the client: not lost, never acknowledged.
    refusals: int = 0
    healthy_after: bool = False
    # Seconds the server was not ready because of the fault (a restart's included).
    recovery_s: float = 0.0
    duration_s: float = 0.0
    skipped: str | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return self.skipped is None and self.healthy_after and not (
            self.lost or self.duplicated_events or self.missing_events or self.wrong_tokens)

    def to_json(self) -> dict:
        return {**asdict(self), "passed": self.passed}


@dataclass
class DrillContext:
    workdir: Path
    # Short form: fewer and shorter requests (CI); the long form is what `rtx chaos` runs by default.
    short: bool = True

    @property
    def num_streams(self) -> int:
        return 8 if self.short else 32

    @property
    def max_tokens(self) -> int:
        return 96 if self.short else 400


# -- helpers ------------------------------------------------------------------------------------------------------


def new_streams(ctx: DrillContext, count: int | None = None, first: int = 0, **kwargs) -> list[Stream]:
    return [Stream(first + i, ctx.max_tokens, **kwargs) for i in range(count or ctx.num_streams)]


def start_all(streams: list[Stream], target: Target, timeout_s: float = 120.0) -> float:
    deadline = time.monotonic() + timeout_s
    for stream in streams:
        stream.start(target, deadline)
    return deadline


def join_all(streams: list[Stream], deadline: float) -> None:
    for stream in streams:
        assert stream.thread is not None
        stream.thread.join(max(0.0, deadline - time.monotonic()) + 1)


def wait_first_events(streams: list[Stream], count: int = 2, timeout_s: float = 60.0) -> None:
    """Wait until every stream has ``count`` events: the fault lands mid-stream."""
    wait_for(lambda: all(len(s.events) >= count or s.error for s in streams), timeout=timeout_s, interval=0.02)


def tally(result: DrillResult, streams: list[Stream], base_url: str,
           failed_by_design: Callable[[Stream], bool] = lambda s: False) -> None:
    """Count each stream: completed (tokens equal to an undisturbed run's), failed by design, or lost."""
    references: dict[tuple[int, int], list[int]] = {}
    for stream in streams:
        result.refusals += stream.refusals
        if stream.req_id is None:
            if stream.error is not None:
                result.lost += 1  # refused for good: the client never got through
                result.notes.append(f"stream {stream.index} never accepted: {stream.error}")
            continue
        result.accepted += 1
        result.duplicated_events += duplicated_events(stream)
        if stream.left:
            continue
        if failed_by_design(stream):
            result.failed_by_design += 1
            continue
        if not stream.finished:
            result.lost += 1
            result.notes.append(f"stream {stream.index} ({stream.req_id}) did not finish: {stream.error or 'cut'}")
            continue
        result.missing_events += missing_events(stream)
        key = (stream.index, stream.max_tokens)
        if key not in references:
            references[key] = reference_tokens(base_url, stream.index, stream.max_tokens)
        if stream.token_ids != references[key]:
            result.wrong_tokens += 1
            result.notes.append(f"stream {stream.index}: tokens differ from the undisturbed run")
        else:
            result.completed += 1


def serves_again(server: ServerProcess) -> bool:
    """Ready, and a new request completes."""
    if not wait_for(lambda: is_ready(server.base_url), timeout=30):
        return False
    body = {"prompt": [1, 2, 3], "max_tokens": 4, "temperature": 0, "ignore_eos": True, "stream": False}
    try:
        return httpx.post(server.base_url + "/generate", json=body, timeout=60).status_code == 200
    except httpx.HTTPError:
        return False


def health_of(base_url: str) -> tuple[int, str]:
    try:
        resp = httpx.get(base_url + "/health", timeout=2)
        return resp.status_code, resp.text
    except httpx.HTTPError as exc:
        return 0, str(exc)


def is_ready(base_url: str) -> bool:
    try:
        return httpx.get(base_url + "/ready", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


@contextlib.contextmanager
def running_server(*args: str, env: dict[str, str] | None = None) -> Iterator[ServerProcess]:
    server = start_server(*MODEL_ARGS, *args, env=env)
    try:
        yield server
    finally:
        server.stop(signal.SIGKILL)


def fsync_shim(ctx: DrillContext) -> Path:
    """``fsync_stall.c`` built into a shared library (with the system's C compiler)."""
    source = Path(__file__).with_name("fsync_stall.c")
    library = ctx.workdir / "fsync_stall.so"
    if not library.exists():
        compiler = shutil.which("cc") or shutil.which("gcc")
        if compiler is None:
            raise RuntimeError("no C compiler (cc) to build the fsync shim")
        subprocess.run([compiler, "-shared", "-fPIC", "-O2", "-o", str(library), str(source), "-ldl"], check=True,
                       capture_output=True)
    return library
