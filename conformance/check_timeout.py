"""A time limit on each check of the suite, so that a plugin that hangs fails a rule instead of hanging the run.

pytest-timeout was the obvious library, but its failure is pytest's own ``Failed`` raised with its own message:
the report could not name the rule broken nor the plugin's line where the check was stuck. Here the limit raises
:class:`CheckTimedOut` inside the check, and the session reports it like any exception escaping a plugin (the kind's
``api`` rule, at the plugin's line). It derives from BaseException so that a plugin's ``except Exception`` does not
swallow it and hypothesis does not shrink (rerun) the example that hung.

It works through SIGALRM: in the main thread on POSIX only (elsewhere checks run without a limit), and a plugin
blocked inside native code that never returns to Python is interrupted only when it does.
"""

from __future__ import annotations

import contextlib
import signal
import threading
import time
from collections.abc import Iterator
from types import FrameType

# Each check's setup, and then its call, may take this long by default. The slowest contract check of the
# built-ins takes about 16 s on a 2-core machine and a gate a few minutes on a CPU: this only catches a hang.
DEFAULT_TIMEOUT_S = 300.0

# After the first alarm, it fires again this often until the check ends: a plugin that catches the first one (a
# bare ``except:``) is interrupted again.
_REPEAT_S = 5.0


class CheckTimedOut(BaseException):
    """A check ran past its time limit (``rtx plugins test --timeout``)."""


def can_limit() -> bool:
    return hasattr(signal, "setitimer") and threading.current_thread() is threading.main_thread()


@contextlib.contextmanager
def time_limit(seconds: float | None, what: str) -> Iterator[None]:
    """Raise :class:`CheckTimedOut` in the block when it runs past ``seconds`` (None or 0: no limit).

    A timer already armed (pytest-timeout's, when the suite runs inside a test session) keeps its deadline: it
    fires through its own handler if it comes first, and is armed again with the time it has left afterwards.
    """
    if not seconds or not can_limit():
        yield
        return
    previous = signal.getsignal(signal.SIGALRM)
    outer_left, outer_interval = signal.getitimer(signal.ITIMER_REAL)
    outer_deadline = time.monotonic() + outer_left if outer_left > 0 else None
    outer_fired = False

    def expire(signum: int, frame: FrameType | None) -> None:
        nonlocal outer_fired
        outer_due = outer_deadline is not None and time.monotonic() >= outer_deadline - 1e-3
        if outer_due and not outer_fired and callable(previous):
            outer_fired = True  # once: its later firings are this limit's own repeats
            previous(signum, frame)
            return
        raise CheckTimedOut(f"{what} did not finish within {seconds:g} s (the --timeout of each check)")

    signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, min(seconds, outer_left) if outer_left > 0 else seconds, _REPEAT_S)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous if previous is not None else signal.SIG_DFL)
        if outer_deadline is not None and not outer_fired:
            signal.setitimer(signal.ITIMER_REAL, max(outer_deadline - time.monotonic(), 1e-3), outer_interval)
        elif outer_fired and outer_interval > 0:
            signal.setitimer(signal.ITIMER_REAL, outer_interval, outer_interval)
