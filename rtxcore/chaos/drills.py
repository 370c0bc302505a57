"""The chaos drills: each starts ``rtx serve`` on 127.0.0.1, puts it under a load of greedy streams, injects one
fault, and counts what survived against an undisturbed run of the same prompts.

For every drill: accepted requests lost (never finished, or failed other than by the fault's own design) and events
duplicated must be 0, the tokens of every finished request must equal the undisturbed run's, and the server must
answer ``/ready`` and a new request afterwards. Each reports the time ``/ready`` was not 200 (or, for a drill that
restarts the server, from the fault until it served again).

Faults are real where this machine allows it: a tmpfs that fills up (needs root, to mount it), a process killed with
SIGKILL or SIGTERM, clients that close their sockets, a host tier smaller than the working set, a rank's process
killed. Slow disks come from ``fsync_stall.c``, loaded with LD_PRELOAD, which delays the real ``fsync``; a plugin that
raises is the ``fault_injection`` logits processor (``RTX_FAULT_INJECTION``).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx

from rtxcore.chaos.load import (
    ReadinessProbe,
    Stream,
    Target,
    duplicated_events,
    missing_events,
    reference_tokens,
)
from rtxcore.chaos.served import ServerProcess, metric, start_server, wait_for

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


def _streams(ctx: DrillContext, count: int | None = None, first: int = 0, **kwargs) -> list[Stream]:
    return [Stream(first + i, ctx.max_tokens, **kwargs) for i in range(count or ctx.num_streams)]


def _run(streams: list[Stream], target: Target, timeout_s: float = 120.0) -> float:
    deadline = time.monotonic() + timeout_s
    for stream in streams:
        stream.start(target, deadline)
    return deadline


def _join(streams: list[Stream], deadline: float) -> None:
    for stream in streams:
        assert stream.thread is not None
        stream.thread.join(max(0.0, deadline - time.monotonic()) + 1)


def _first_tokens(streams: list[Stream], count: int = 2, timeout_s: float = 60.0) -> None:
    """Wait until every stream has ``count`` events: the fault lands mid-stream."""
    wait_for(lambda: all(len(s.events) >= count or s.error for s in streams), timeout=timeout_s, interval=0.02)


def _tally(result: DrillResult, streams: list[Stream], base_url: str,
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


def _healthy(server: ServerProcess) -> bool:
    """Ready, and a new request completes."""
    if not wait_for(lambda: _ready(server.base_url), timeout=30):
        return False
    body = {"prompt": [1, 2, 3], "max_tokens": 4, "temperature": 0, "ignore_eos": True, "stream": False}
    try:
        return httpx.post(server.base_url + "/generate", json=body, timeout=60).status_code == 200
    except httpx.HTTPError:
        return False


def _health(base_url: str) -> tuple[int, str]:
    try:
        resp = httpx.get(base_url + "/health", timeout=2)
        return resp.status_code, resp.text
    except httpx.HTTPError as exc:
        return 0, str(exc)


def _ready(base_url: str) -> bool:
    try:
        return httpx.get(base_url + "/ready", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


@contextlib.contextmanager
def _server(*args: str, env: dict[str, str] | None = None) -> Iterator[ServerProcess]:
    server = start_server(*MODEL_ARGS, *args, env=env)
    try:
        yield server
    finally:
        server.stop(signal.SIGKILL)


def _shim(ctx: DrillContext) -> Path:
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


# -- the drills ---------------------------------------------------------------------------------------------------


def plugin_fault(ctx: DrillContext, result: DrillResult) -> None:
    """A logits-processor plugin raises on one request in four, mid-stream: those fail alone, with an error naming
    the plugin; the others run on undisturbed."""
    state = ctx.workdir / "state"
    with _server("--state-dir", str(state), env={"RTX_FAULT_INJECTION": "1"}) as server:
        target = Target(server.base_url)
        faulty = {"logits_processors": {"fault_injection": {"fail_after_tokens": 5}}}
        streams = [Stream(i, ctx.max_tokens, extra=faulty if i % 4 == 3 else {}) for i in range(ctx.num_streams)]
        with ReadinessProbe(target) as probe:
            _join(streams, _run(streams, target))
        result.recovery_s = probe.not_ready_s()

        def by_design(stream: Stream) -> bool:
            return bool(stream.extra) and "fault_injection" in (stream.error or "")

        _tally(result, streams, server.base_url, by_design)
        expected = sum(1 for s in streams if s.extra)
        if result.failed_by_design != expected:
            result.lost += expected - result.failed_by_design
            result.notes.append(f"{result.failed_by_design} of {expected} faulty requests failed naming the plugin")
        result.notes.append(f"rtx_request_failures_total: {metric(server, 'rtx_request_failures_total'):g}")
        result.healthy_after = _healthy(server)


def disk_full(ctx: DrillContext, result: DrillResult) -> None:
    """The journal's disk fills up under load, then is freed: running requests go on, new ones are refused with 503
    meanwhile (and sent again), and after a kill -9 the journal replays every request's events as they were sent."""
    mount = ctx.workdir / "small-disk"
    mount.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(mount)], capture_output=True).returncode:
        result.skipped = "mounting a small tmpfs needs root (CAP_SYS_ADMIN) on this machine"
        return
    try:
        state = mount / "state"
        args = ("--state-dir", str(state), "--kv-disk-dir", str(ctx.workdir / "kv"))
        with _server(*args) as server:
            target = Target(server.base_url)
            streams = _streams(ctx)
            with ReadinessProbe(target) as probe:
                deadline = _run(streams, target)
                _first_tokens(streams)
                filler = mount / "filler"
                _fill(filler)
                late = _streams(ctx, 3, first=ctx.num_streams)
                _run(late, target)  # sent while the disk is full: refused until it is freed
                time.sleep(1.5)
                filler.unlink()
                freed_at = time.monotonic()
                _join(streams + late, deadline)
                wait_for(lambda: _ready(server.base_url), timeout=30)
            result.recovery_s = probe.not_ready_s()
            back = probe.ready_after(freed_at)
            result.notes.append(f"ready {back:.2f} s after the disk was freed" if back is not None
                                else "not ready again after the disk was freed")
            _tally(result, streams + late, server.base_url)
            if not any(s.refusals for s in late):
                result.notes.append("no request was refused while the disk was full")
            server.stop(signal.SIGKILL)
        with _server(*args) as server:
            # Every event a client saw is in the journal, once, in order.
            for stream in streams[:3]:
                replay = Stream(stream.index, stream.max_tokens, req_id=stream.req_id)
                replay.run(Target(server.base_url), time.monotonic() + 30)
                if replay.events != stream.events:
                    result.lost += 1
                    result.notes.append(f"stream {stream.index}: the journal replays other events than were sent")
            result.healthy_after = _healthy(server)
    finally:
        subprocess.run(["umount", "-l", str(mount)], capture_output=True)


def _fill(path: Path) -> None:
    with open(path, "wb") as f:
        try:
            while True:
                f.write(b"\0" * 65536)
                f.flush()
        except OSError:
            pass


def slow_fsync(ctx: DrillContext, result: DrillResult) -> None:
    """Every fsync stalls 300 ms for 3 s under load (an overloaded disk): admissions wait for their group commit,
    nothing fails, nothing is lost."""
    control = ctx.workdir / "control"
    control.mkdir()
    env = {"LD_PRELOAD": str(_shim(ctx)), "RTX_CHAOS_CONTROL_DIR": str(control)}
    with _server("--state-dir", str(ctx.workdir / "state"), env=env) as server:
        target = Target(server.base_url)
        streams = _streams(ctx)
        with ReadinessProbe(target) as probe:
            deadline = _run(streams, target)
            _first_tokens(streams)
            (control / "fsync_stall_ms").write_text("300")
            late = _streams(ctx, 4, first=ctx.num_streams)
            _run(late, target)
            time.sleep(3)
            (control / "fsync_stall_ms").unlink()
            _join(streams + late, deadline)
        result.recovery_s = probe.not_ready_s()
        _tally(result, streams + late, server.base_url)
        waits = [s.accepted_at - s.sent_at for s in late if s.accepted_at is not None]
        if waits:
            result.notes.append(f"admission during the stall took up to {max(waits):.2f} s")
        result.healthy_after = _healthy(server)


def host_tier_full(ctx: DrillContext, result: DrillResult) -> None:
    """The KV host tier is far smaller than what is offloaded into it (and the device cache small): it evicts all
    the time; requests are unaffected."""
    args = ("--num-kv-blocks", "64", "--kv-host-bytes", "256k", "--max-num-seqs", "4")
    with _server(*args) as server:
        target = Target(server.base_url)
        streams = _streams(ctx, ctx.num_streams * 2)
        with ReadinessProbe(target) as probe:
            _join(streams, _run(streams, target, timeout_s=240))
        result.recovery_s = probe.not_ready_s()
        _tally(result, streams, server.base_url)
        evictions = metric(server, "rtx_kv_tier_evictions_total")
        result.notes.append(f"host tier: {metric(server, 'rtx_kv_offload_blocks_total'):g} blocks offloaded, "
                            f"{evictions:g} evicted")
        if evictions == 0:
            result.notes.append("the host tier never filled up: the drill did not exercise it")
            result.lost += 1
        result.healthy_after = _healthy(server)


def disconnect_storm(ctx: DrillContext, result: DrillResult) -> None:
    """Three clients in four close their connection mid-stream at once (no journal, so their requests are aborted):
    every abort frees its KV blocks, the others finish undisturbed."""
    with _server() as server:
        target = Target(server.base_url)
        streams = [Stream(i, ctx.max_tokens * 2, resumable=False, leave_after=3 if i % 4 else None)
                   for i in range(ctx.num_streams * 2)]
        with ReadinessProbe(target) as probe:
            _join(streams, _run(streams, target))
        result.recovery_s = probe.not_ready_s()
        _tally(result, streams, server.base_url)
        left = sum(1 for s in streams if s.left)
        aborted = wait_for(lambda: metric(server, "rtx_request_aborts_total") >= left, timeout=30)
        freed = wait_for(lambda: metric(server, "rtx_kv_cache_usage_ratio") == 0, timeout=30)
        result.notes.append(f"{left} clients left; aborts {metric(server, 'rtx_request_aborts_total'):g}; "
                            f"KV in use afterwards {metric(server, 'rtx_kv_cache_usage_ratio'):g}")
        if not (aborted and freed):
            result.lost += 1
        result.healthy_after = _healthy(server)


def sigterm_burst(ctx: DrillContext, result: DrillResult) -> None:
    """SIGTERM right after a burst is accepted: the server drains (new requests get 503), every accepted request
    finishes before it exits 0, and the restart serves again."""
    state = ctx.workdir / "state"
    server = start_server(*MODEL_ARGS, "--state-dir", str(state), "--shutdown-grace", "60")
    target = Target(server.base_url)
    streams = _streams(ctx)
    deadline = _run(streams, target)
    _first_tokens(streams, 1)
    stopped_at = time.monotonic()
    server.send_signal(signal.SIGTERM)
    late = _streams(ctx, 2, first=ctx.num_streams)
    _run(late, target)  # refused while draining, sent again to the restarted server
    try:
        server.proc.wait(120)  # a second SIGTERM would skip the drain
    except subprocess.TimeoutExpired:
        result.notes.append("still draining after 120 s")
    code = server.stop(signal.SIGKILL)
    if code != 0:
        result.notes.append(f"exit code {code} after SIGTERM")
        result.lost += 1
    wait_for(lambda: all(s.finished for s in streams), timeout=5)  # the clients read what the drain sent
    drained = [s for s in streams if s.finished]
    result.notes.append(f"{len(drained)} of {len(streams)} finished during the drain")
    if len(drained) < len(streams):
        result.lost += len(streams) - len(drained)  # the grace period was long enough for all of them
    with _server("--state-dir", str(state)) as server:
        result.recovery_s = time.monotonic() - stopped_at
        target.base_url = server.base_url
        _join(streams + late, deadline)
        _tally(result, streams + late, server.base_url)
        result.healthy_after = _healthy(server)


def kill_during_compaction(ctx: DrillContext, result: DrillResult) -> None:
    """SIGKILL while the journal is being compacted (its temporary file written, not yet renamed): the restart
    reads a whole journal and every stream resumes where its client was, each event once."""
    control = ctx.workdir / "control"
    control.mkdir()
    env = {"LD_PRELOAD": str(_shim(ctx)), "RTX_CHAOS_CONTROL_DIR": str(control)}
    state = ctx.workdir / "state"
    args = ("--state-dir", str(state), "--journal-retention", "0", "--journal-compact-bytes", "16k")
    server = start_server(*MODEL_ARGS, *args, env=env)
    target = Target(server.base_url)
    try:
        finished = _streams(ctx, ctx.num_streams, first=100)  # garbage for the compaction to drop
        _join(finished, _run(finished, target))
        streams = _streams(ctx)
        deadline = _run(streams, target)
        _first_tokens(streams, 3)
        (control / "hold_tmp_fsync").touch()
        held = wait_for(lambda: (control / "tmp_fsync_held").exists(), timeout=60, interval=0.01)
        killed_at = time.monotonic()
        server.stop(signal.SIGKILL)
        if not held:
            result.notes.append("no compaction started: killed under load instead")
            result.lost += 1
    finally:
        (control / "hold_tmp_fsync").unlink(missing_ok=True)
        server.stop(signal.SIGKILL)
    leftovers = [p.name for p in (state / "journal").iterdir() if ".tmp" in p.name]
    result.notes.append(f"left by the kill: {', '.join(leftovers) or 'no temporary file'}")
    with _server(*args, env=env) as server:
        result.recovery_s = time.monotonic() - killed_at
        target.base_url = server.base_url
        _join(streams, deadline)
        _tally(result, streams, server.base_url)
        result.healthy_after = _healthy(server)


def worker_killed(ctx: DrillContext, result: DrillResult) -> None:
    """A tensor-parallel rank's process is killed: the server's liveness probe fails naming the rank (its steps
    cannot run), it is restarted as an orchestrator would, and it resumes every journaled request exactly once."""
    state = ctx.workdir / "state"
    args = ("--state-dir", str(state), "--device", "cpu", "--dtype", "float32", "--tensor-parallel-size", "2")
    server = start_server(*MODEL_ARGS, *args)
    target = Target(server.base_url)
    try:
        workers = _spawned_children(server.proc.pid)
        streams = _streams(ctx)
        deadline = _run(streams, target)
        _first_tokens(streams, 3)
        killed_at = time.monotonic()
        os.kill(workers[0], signal.SIGKILL)
        if not wait_for(lambda: _health(server.base_url)[0] == 503, timeout=30):
            result.notes.append("liveness still 200 after a rank died")
            result.lost += 1
        else:
            result.notes.append(f"/health: {_health(server.base_url)[1][:120]}")
    finally:
        server.stop(signal.SIGKILL)
    with _server(*args) as server:
        result.recovery_s = time.monotonic() - killed_at
        target.base_url = server.base_url
        _join(streams, deadline)
        _tally(result, streams, server.base_url)
        result.healthy_after = _healthy(server)


def _spawned_children(pid: int) -> list[int]:
    """Children of ``pid`` started by multiprocessing's "spawn" (the ranks; not its resource tracker)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except (OSError, IndexError, ValueError):
            continue  # gone meanwhile
        if ppid == pid and "spawn_main" in cmdline:
            found.append(int(entry.name))
    if not found:
        raise RuntimeError(f"no rank process under the server (pid {pid})")
    return found


DRILLS: dict[str, Callable[[DrillContext, DrillResult], None]] = {
    "plugin-fault": plugin_fault,
    "disk-full": disk_full,
    "slow-fsync": slow_fsync,
    "host-tier-full": host_tier_full,
    "disconnect-storm": disconnect_storm,
    "sigterm-burst": sigterm_burst,
    "kill-during-compaction": kill_during_compaction,
    "worker-killed": worker_killed,
}


def run_drill(name: str, short: bool = True, workdir: Path | None = None) -> DrillResult:
    """Run one drill in a fresh working directory (removed afterwards unless given)."""
    result = DrillResult(name)
    started = time.monotonic()
    with contextlib.ExitStack() as stack:
        folder = workdir or Path(stack.enter_context(tempfile.TemporaryDirectory(prefix=f"rtx-chaos-{name}-")))
        DRILLS[name](DrillContext(folder, short), result)
    result.duration_s = time.monotonic() - started
    return result
