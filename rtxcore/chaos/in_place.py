"""Drills whose server keeps running through the fault: a failing plugin, the journal's disk full, fsync stalls, a
host tier too small, a storm of disconnecting clients."""

from __future__ import annotations

import signal
import subprocess
import time
from pathlib import Path

from rtxcore.chaos.harness import (
    DrillContext,
    DrillResult,
    fsync_shim,
    is_ready,
    join_all,
    new_streams,
    running_server,
    serves_again,
    start_all,
    tally,
    wait_first_events,
)
from rtxcore.chaos.load import ReadinessProbe, Stream, Target
from rtxcore.chaos.served import metric, wait_for


def plugin_fault(ctx: DrillContext, result: DrillResult) -> None:
    """A logits-processor plugin raises on one request in four, mid-stream: those fail alone, with an error naming
    the plugin; the others run on undisturbed."""
    state = ctx.workdir / "state"
    with running_server("--state-dir", str(state), env={"RTX_FAULT_INJECTION": "1"}) as server:
        target = Target(server.base_url)
        faulty = {"logits_processors": {"fault_injection": {"fail_after_tokens": 5}}}
        streams = [Stream(i, ctx.max_tokens, extra=faulty if i % 4 == 3 else {}) for i in range(ctx.num_streams)]
        with ReadinessProbe(target) as probe:
            join_all(streams, start_all(streams, target))
        result.recovery_s = probe.not_ready_s()

        def by_design(stream: Stream) -> bool:
            return bool(stream.extra) and "fault_injection" in (stream.error or "")

        tally(result, streams, server.base_url, by_design)
        expected = sum(1 for s in streams if s.extra)
        if result.failed_by_design != expected:
            result.lost += expected - result.failed_by_design
            result.notes.append(f"{result.failed_by_design} of {expected} faulty requests failed naming the plugin")
        result.notes.append(f"rtx_request_failures_total: {metric(server, 'rtx_request_failures_total'):g}")
        result.healthy_after = serves_again(server)


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
        with running_server(*args) as server:
            target = Target(server.base_url)
            streams = new_streams(ctx)
            with ReadinessProbe(target) as probe:
                deadline = start_all(streams, target)
                wait_first_events(streams)
                filler = mount / "filler"
                _fill(filler)
                late = new_streams(ctx, 3, first=ctx.num_streams)
                start_all(late, target)  # sent while the disk is full: refused until it is freed
                time.sleep(1.5)
                filler.unlink()
                freed_at = time.monotonic()
                join_all(streams + late, deadline)
                wait_for(lambda: is_ready(server.base_url), timeout=30)
            result.recovery_s = probe.not_ready_s()
            back = probe.ready_after(freed_at)
            result.notes.append(f"ready {back:.2f} s after the disk was freed" if back is not None
                                else "not ready again after the disk was freed")
            tally(result, streams + late, server.base_url)
            if not any(s.refusals for s in late):
                result.notes.append("no request was refused while the disk was full")
            server.stop(signal.SIGKILL)
        with running_server(*args) as server:
            # Every event a client saw is in the journal, once, in order.
            for stream in streams[:3]:
                replay = Stream(stream.index, stream.max_tokens, req_id=stream.req_id)
                replay.run(Target(server.base_url), time.monotonic() + 30)
                if replay.events != stream.events:
                    result.lost += 1
                    result.notes.append(f"stream {stream.index}: the journal replays other events than were sent")
            result.healthy_after = serves_again(server)
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
    env = {"LD_PRELOAD": str(fsync_shim(ctx)), "RTX_CHAOS_CONTROL_DIR": str(control)}
    with running_server("--state-dir", str(ctx.workdir / "state"), env=env) as server:
        target = Target(server.base_url)
        streams = new_streams(ctx)
        with ReadinessProbe(target) as probe:
            deadline = start_all(streams, target)
            wait_first_events(streams)
            (control / "fsync_stall_ms").write_text("300")
            late = new_streams(ctx, 4, first=ctx.num_streams)
            start_all(late, target)
            time.sleep(3)
            (control / "fsync_stall_ms").unlink()
            join_all(streams + late, deadline)
        result.recovery_s = probe.not_ready_s()
        tally(result, streams + late, server.base_url)
        waits = [s.accepted_at - s.sent_at for s in late if s.accepted_at is not None]
        if waits:
            result.notes.append(f"admission during the stall took up to {max(waits):.2f} s")
        result.healthy_after = serves_again(server)


def host_tier_full(ctx: DrillContext, result: DrillResult) -> None:
    """The KV host tier is far smaller than what is offloaded into it (and the device cache small): it evicts all
    the time; requests are unaffected."""
    args = ("--num-kv-blocks", "64", "--kv-host-bytes", "256k", "--max-num-seqs", "4")
    with running_server(*args) as server:
        target = Target(server.base_url)
        streams = new_streams(ctx, ctx.num_streams * 2)
        with ReadinessProbe(target) as probe:
            join_all(streams, start_all(streams, target, timeout_s=240))
        result.recovery_s = probe.not_ready_s()
        tally(result, streams, server.base_url)
        evictions = metric(server, "rtx_kv_tier_evictions_total")
        result.notes.append(f"host tier: {metric(server, 'rtx_kv_offload_blocks_total'):g} blocks offloaded, "
                            f"{evictions:g} evicted")
        if evictions == 0:
            result.notes.append("the host tier never filled up: the drill did not exercise it")
            result.lost += 1
        result.healthy_after = serves_again(server)


def disconnect_storm(ctx: DrillContext, result: DrillResult) -> None:
    """Three clients in four close their connection mid-stream at once (no journal, so their requests are aborted):
    every abort frees its KV blocks, the others finish undisturbed."""
    with running_server() as server:
        target = Target(server.base_url)
        streams = [Stream(i, ctx.max_tokens * 2, resumable=False, leave_after=3 if i % 4 else None)
                   for i in range(ctx.num_streams * 2)]
        with ReadinessProbe(target) as probe:
            join_all(streams, start_all(streams, target))
        result.recovery_s = probe.not_ready_s()
        tally(result, streams, server.base_url)
        left = sum(1 for s in streams if s.left)
        aborted = wait_for(lambda: metric(server, "rtx_request_aborts_total") >= left, timeout=30)
        freed = wait_for(lambda: metric(server, "rtx_kv_cache_usage_ratio") == 0, timeout=30)
        result.notes.append(f"{left} clients left; aborts {metric(server, 'rtx_request_aborts_total'):g}; "
                            f"KV in use afterwards {metric(server, 'rtx_kv_cache_usage_ratio'):g}")
        if not (aborted and freed):
            result.lost += 1
        result.healthy_after = serves_again(server)
