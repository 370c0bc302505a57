"""Progress of long work (model loading, quantization, benchmarks) on stderr.

On a terminal it is a tqdm bar with rate and ETA. When stderr is not a terminal (pod logs, CI, a pipe) a bar's
carriage returns would pile up into one endless line, so each report is a whole line instead, at most one every
``interval_s`` seconds, and a last one when the work is done::

    weights: 120/272 (44%) 3.1s elapsed, ETA 3.9s
    weights: 272/272 (100%) 7.0s elapsed

    progress = Progress("weights", unit="tensor")
    progress(0, len(tensors))  # optional: the clock starts at the first report
    for done, tensor in enumerate(tensors, 1):
        ...
        progress(done, len(tensors))  # done == total ends the bar, or prints the last line
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any, TextIO

# Least seconds between two plain lines: enough to show a log is alive without flooding it.
DEFAULT_INTERVAL_S = 5.0


class Progress:
    """``progress(done, total)``: ``done`` of ``total`` units are finished (the ``Callable[[int, int], None]`` that
    model sources, the engine and the pipelines take). Elapsed time, rate and ETA count from the first report, so
    that work before it (calibration before the layers are quantized) does not skew them: callers report
    ``progress(0, total)`` as the work starts. Calls after the one with ``done >= total`` are ignored.

    :param enabled: False prints nothing; None (when stderr exists) and True print.
    :param interval_s: least seconds between two plain lines when stderr is not a terminal; the last line is always
        printed. The bar on a terminal redraws at most ten times a second whatever this is.
    :param unit: what is counted, for the bar's rate (``tensor/s``).
    """

    def __init__(self, label: str, enabled: bool | None = None, *, interval_s: float = DEFAULT_INTERVAL_S,
                 unit: str = "it"):
        if not interval_s >= 0:
            raise ValueError(f"interval_s must be >= 0, got {interval_s}")
        self.label = label
        self.unit = unit
        self.interval_s = interval_s
        # Looked up now, not at import: a test or a caller may have replaced sys.stderr.
        self._stream: TextIO | None = sys.stderr
        self.enabled = self._stream is not None if enabled is None else enabled
        self._tty = self.enabled and _is_terminal(self._stream)
        self._bar: Any = None  # a tqdm bar, made at the first report on a terminal
        # The first report's time and count: the clock starts there.
        self._first: tuple[float, int] | None = None
        self._last_line = 0.0
        self._finished = False

    def __call__(self, done: int, total: int) -> None:
        if not self.enabled or self._finished:
            return
        finished = done >= total
        if self._tty:
            bar = self._draw(done, total)
            if finished:
                self._finished = True
                bar.close()  # leaves the finished bar on screen and ends its line
            return
        now = time.monotonic()
        if self._first is None:
            self._first = now, done
            self._last_line = now
        if finished or now - self._last_line >= self.interval_s:
            self._finished = finished
            self._last_line = now
            self._print(self._line(done, total, now, *self._first))

    def write(self, text: str) -> None:
        """A line of other text (a warning, the start of a phase), printed even when progress is disabled; on a
        terminal the bar moves below it instead of being cut by it."""
        if self._bar is not None and not self._finished:
            self._bar.write(text, file=self._stream)
        else:
            self._print(text)

    def _draw(self, done: int, total: int) -> Any:
        if self._bar is None:
            from tqdm import tqdm  # type: ignore[import-untyped]  # tqdm ships no type information

            self._bar = tqdm(total=total, desc=self.label, unit=self.unit, file=self._stream, dynamic_ncols=True)
        elif self._bar.total != total:
            self._bar.total = total
        self._bar.update(done - self._bar.n)
        return self._bar

    def _line(self, done: int, total: int, now: float, start: float, first_done: int) -> str:
        fraction = done / total if total > 0 else 1.0
        text = f"{self.label}: {done}/{total} ({fraction:.0%}) {_duration(now - start)} elapsed"
        if first_done < done < total:
            text += f", ETA {_duration((now - start) * (total - done) / (done - first_done))}"
        return text

    def _print(self, text: str) -> None:
        if self._stream is not None:
            self._stream.write(text + "\n")
            self._stream.flush()


def _duration(seconds: float) -> str:
    if seconds < 59.95:  # what rounds to 60.0s is shown as 1m00s
        return f"{seconds:.1f}s"
    minutes, rest = divmod(round(seconds), 60)
    return f"{minutes}m{rest:02d}s" if minutes < 60 else f"{minutes // 60}h{minutes % 60:02d}m"


def _is_terminal(stream: TextIO | None) -> bool:
    """A terminal that knows its width: tqdm draws nothing on one of 0 columns (a pseudo-terminal nobody sized)."""
    try:
        return stream is not None and stream.isatty() and os.get_terminal_size(stream.fileno()).columns > 0
    except (AttributeError, OSError, ValueError):  # no file descriptor, or a closed stream
        return False
