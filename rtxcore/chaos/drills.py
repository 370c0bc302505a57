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
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from rtxcore.chaos.harness import DrillContext, DrillResult
from rtxcore.chaos.in_place import disconnect_storm, disk_full, host_tier_full, plugin_fault, slow_fsync
from rtxcore.chaos.restarts import kill_during_compaction, sigterm_burst, worker_killed

__all__ = ["DRILLS", "DrillContext", "DrillResult", "run_drill"]

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
