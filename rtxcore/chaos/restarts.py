"""Drills that end or restart the server: SIGTERM in a burst, SIGKILL during a journal compaction, a tensor-parallel
rank killed. Every accepted request must still complete, each event once."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

from rtxcore.chaos.harness import (
    MODEL_ARGS,
    DrillContext,
    DrillResult,
    fsync_shim,
    health_of,
    join_all,
    new_streams,
    running_server,
    serves_again,
    start_all,
    tally,
    wait_first_events,
)
from rtxcore.chaos.load import Stream, Target
from rtxcore.chaos.served import start_server, wait_for


def sigterm_burst(ctx: DrillContext, result: DrillResult) -> None:
    """SIGTERM right after a burst is accepted: the server drains (new requests get 503), every accepted request
    finishes before it exits 0, and the restart serves again."""
    state = ctx.workdir / "state"
    server = start_server(*MODEL_ARGS, "--state-dir", str(state), "--shutdown-grace", "60")
    target = Target(server.base_url)
    streams = new_streams(ctx)
    deadline = start_all(streams, target)
    wait_first_events(streams, 1)
    stopped_at = time.monotonic()
    server.send_signal(signal.SIGTERM)
    late = new_streams(ctx, 2, first=ctx.num_streams)
    start_all(late, target)  # refused while draining, sent again to the restarted server
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
    with running_server("--state-dir", str(state)) as server:
        result.recovery_s = time.monotonic() - stopped_at
        target.base_url = server.base_url
        join_all(streams + late, deadline)
        tally(result, streams + late, server.base_url)
        result.healthy_after = serves_again(server)


def kill_during_compaction(ctx: DrillContext, result: DrillResult) -> None:
    """SIGKILL while the journal is being compacted (its temporary file written, not yet renamed) and streams are
    running: the restart reads a whole journal, removes the temporary file, and every stream resumes where its client
    was, each event once.

    Compaction starts once the journal is over ``--journal-compact-bytes`` and at least half of it is past retention,
    which the journal checks every 0.2 s, after its fsync. Sized in bytes, not time: a first server runs eight rounds
    of requests to their end (with retention 0, all garbage), the journal they leave is G bytes, and the server
    restarted on it compacts once it is over 1.25 G and while it is under 2 G, i.e. while the running streams have
    written between a quarter and the whole of G: from about 17% to 67% of their output, a window a check cannot miss
    however fast the model runs (the first version allowed half of one round's bytes, which a fast dummy:tiny wrote
    between two checks; four rounds, 8% to 33%, were once missed on a loaded CI machine whose fsyncs spaced the
    checks further apart). The shim holds that compaction's fsync from the start (no earlier one can happen), and
    the drill kills the server there."""
    control = ctx.workdir / "control"
    control.mkdir()
    env = {"LD_PRELOAD": str(fsync_shim(ctx)), "RTX_CHAOS_CONTROL_DIR": str(control)}
    state = ctx.workdir / "state"
    journal = state / "journal" / "journal.log"
    base = ("--state-dir", str(state), "--journal-retention", "0")
    with running_server(*base, "--journal-compact-bytes", "1g") as server:
        for round_ in range(8):
            finished = new_streams(ctx, ctx.num_streams, first=100 + round_ * ctx.num_streams)
            join_all(finished, start_all(finished, Target(server.base_url)))
        server.stop()  # SIGTERM: the journal flushed, its garbage kept (compaction never reached 1 GiB)
    garbage = journal.stat().st_size
    args = (*base, "--journal-compact-bytes", str(garbage * 5 // 4))
    (control / "hold_tmp_fsync").touch()
    server = start_server(*MODEL_ARGS, *args, env=env)
    target = Target(server.base_url)
    try:
        streams = [Stream(i, ctx.max_tokens * 12) for i in range(ctx.num_streams)]
        deadline = start_all(streams, target)
        held = wait_for(lambda: (control / "tmp_fsync_held").exists(), timeout=60, interval=0.01)
        killed_at = time.monotonic()
        server.stop(signal.SIGKILL)
        running = sum(1 for s in streams if not s.finished)
        result.notes.append(f"{running} of {len(streams)} streams running at the kill")
        if not held:
            result.notes.append("no compaction started: killed under load instead")
            result.lost += 1
        if running < len(streams):
            result.notes.append("a stream ended before the compaction started")
            result.lost += len(streams) - running
    finally:
        (control / "hold_tmp_fsync").unlink(missing_ok=True)
        server.stop(signal.SIGKILL)
    leftovers = [p.name for p in journal.parent.iterdir() if ".tmp" in p.name]
    result.notes.append(f"left by the kill: {', '.join(leftovers) or 'no temporary file'}")
    with running_server(*args, env=env) as server:
        result.recovery_s = time.monotonic() - killed_at
        target.base_url = server.base_url
        if any(".tmp" in p.name for p in journal.parent.iterdir()):
            result.notes.append("the restart left the interrupted compaction's file behind")
            result.lost += 1
        join_all(streams, deadline)
        tally(result, streams, server.base_url)
        result.healthy_after = serves_again(server)


def worker_killed(ctx: DrillContext, result: DrillResult) -> None:
    """A tensor-parallel rank's process is killed: the server's liveness probe fails naming the rank (its steps
    cannot run), it is restarted as an orchestrator would, and it resumes every journaled request exactly once."""
    state = ctx.workdir / "state"
    args = ("--state-dir", str(state), "--device", "cpu", "--dtype", "float32", "--tensor-parallel-size", "2")
    server = start_server(*MODEL_ARGS, *args)
    target = Target(server.base_url)
    try:
        workers = _spawned_children(server.proc.pid)
        streams = new_streams(ctx)
        deadline = start_all(streams, target)
        wait_first_events(streams, 3)
        killed_at = time.monotonic()
        os.kill(workers[0], signal.SIGKILL)
        if not wait_for(lambda: health_of(server.base_url)[0] == 503, timeout=30):
            result.notes.append("liveness still 200 after a rank died")
            result.lost += 1
        else:
            result.notes.append(f"/health: {health_of(server.base_url)[1][:120]}")
    finally:
        server.stop(signal.SIGKILL)
    with running_server(*args) as server:
        result.recovery_s = time.monotonic() - killed_at
        target.base_url = server.base_url
        join_all(streams, deadline)
        tally(result, streams, server.base_url)
        result.healthy_after = serves_again(server)


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
