"""A one-line progress indicator on stderr for long work (model loading, benchmarks)."""

from __future__ import annotations

import sys
import time


class Progress:
    def __init__(self, label: str, enabled: bool | None = None):
        self.label = label
        self.enabled = sys.stderr.isatty() if enabled is None else enabled
        self._start = time.monotonic()
        self._last = 0.0

    def __call__(self, done: int, total: int) -> None:
        now = time.monotonic()
        # Redrawing on every call would cost more than the work on fast loops.
        if not self.enabled or (done < total and now - self._last < 0.1):
            return
        self._last = now
        width = 30
        filled = width * done // max(total, 1)
        sys.stderr.write(f"\r{self.label} [{'#' * filled}{'.' * (width - filled)}] {done}/{total} "
                         f"{now - self._start:5.1f}s")
        if done >= total:
            sys.stderr.write("\n")
        sys.stderr.flush()
