"""``rtx serve`` with pipeline-parallel ranks: a worker that dies fails the server's health instead of hanging it,
and the restart resumes the journaled request like a single-process server."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import httpx

from tests.helpers.server import metric, start_server, wait_for
from tests.server.test_durable_restart import StreamClient, uninterrupted_greedy, wait_until

PARALLEL_ARGS = ("--model", "dummy:tiny", "--no-grpc", "--device", "cpu", "--dtype", "float32",
                 "--pipeline-parallel-size", "2")


def spawned_workers(pid: int) -> list[int]:
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
    return found


def test_a_dead_rank_fails_health_and_the_restart_resumes_the_request(tmp_path):
    state = str(tmp_path / "state")
    server = start_server(*PARALLEL_ARGS, "--state-dir", state)
    try:
        [worker] = spawned_workers(server.proc.pid)
        stream = StreamClient(0, native=True, read_at_most=None, max_tokens=300)
        stream.start(server.base_url)
        wait_until(lambda: len(stream.events) >= 3)
        os.kill(worker, signal.SIGKILL)
        # The next step raises (rank 1 is gone): the engine loop fails, /health says so, the stream ends.
        assert wait_for(lambda: httpx.get(server.base_url + "/health").status_code == 503, timeout=30)
        assert "worker rank 1" in httpx.get(server.base_url + "/health").json()["error"]
        stream.thread.join(30)
        assert not stream.thread.is_alive(), "the stream must end, not hang, when a rank dies"
        assert stream.events and not stream.events[-1][1].get("finished"), "cut, as by a crash: no last event"
    finally:
        server.stop(signal.SIGKILL)

    server = start_server(*PARALLEL_ARGS, "--state-dir", state)
    try:
        assert metric(server, "rtx_journal_resumed_requests_total") == 1
        stream.resume(server.base_url)
        expected = uninterrupted_greedy(server, 0, max_tokens=300)
    finally:
        server.stop()
    assert stream.events[-1][1]["finished"] is True
    assert stream.token_ids() == expected  # every token once: the first server's, then the resumed ones
