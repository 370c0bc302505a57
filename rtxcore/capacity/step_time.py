"""How long an engine step takes as a function of the tokens it computes, learnt from the steps themselves.

A step costs a fixed part (weights read once, launch and host overhead) plus a part per token; the model
``seconds = base + per_token * tokens`` is fitted by least squares with exponential forgetting, so it follows the
machine as load, batch shapes and contention change. It is fed the gap between two back-to-back ``schedule()``
calls: the step between them with everything the engine's thread did around it (outputs, the inbox, the servers'
threads competing for the host), which is what requests wait for.

Two users, two memories: the sla-lanes scheduler's admission follows the last few dozen steps
(:class:`StepTimeModel`'s default), while capacity planning wants what a long stretch of live load looked like,
its spread included (:class:`StepTimeRecorder`, kept by every engine and exported in its metrics).
"""

from __future__ import annotations

import bisect
from collections import deque
from dataclasses import dataclass, field


@dataclass(slots=True)
class StepTimeModel:
    # Weight of the newest sample against all before it (an effective memory of about 1/forget steps).
    forget: float = 0.05
    # Samples needed before predictions are trusted (before that, admission does not refuse on predicted wait).
    min_samples: int = 8
    num_samples: int = 0
    _w: float = 0.0
    _x: float = 0.0
    _y: float = 0.0
    _xx: float = 0.0
    _xy: float = 0.0

    def observe(self, num_tokens: int, seconds: float) -> None:
        keep = 1.0 - self.forget
        self._w = keep * self._w + 1.0
        self._x = keep * self._x + num_tokens
        self._y = keep * self._y + seconds
        self._xx = keep * self._xx + num_tokens * num_tokens
        self._xy = keep * self._xy + num_tokens * seconds
        self.num_samples += 1

    @property
    def ready(self) -> bool:
        return self.num_samples >= self.min_samples

    def coefficients(self) -> tuple[float, float]:
        """``(base_s, per_token_s)``, both >= 0."""
        if self._w == 0:
            return 0.0, 0.0
        mean_x, mean_y = self._x / self._w, self._y / self._w
        var_x = self._xx / self._w - mean_x * mean_x
        if var_x <= 1e-9 * max(1.0, mean_x * mean_x):
            # Every recent step had the same size: all of it is attributed to tokens, which over-predicts small
            # steps slightly rather than under-predicting big ones.
            return 0.0, mean_y / max(mean_x, 1.0)
        per_token = (self._xy / self._w - mean_x * mean_y) / var_x
        base = mean_y - per_token * mean_x
        if per_token < 0:  # noise on a flat curve: no per-token part
            return max(mean_y, 0.0), 0.0
        if base < 0:
            return 0.0, mean_y / max(mean_x, 1.0)
        return base, per_token

    def predict(self, num_tokens: int) -> float:
        base, per_token = self.coefficients()
        return base + per_token * num_tokens


# The recorder's memory (about 1/forget steps): minutes of live load at a few steps a second.
RECORDER_FORGET = 0.002
RECORDER_MIN_SAMPLES = 50
# Ratios of each step's time to the model's prediction kept for the spread, and the quantiles exported of them
# (1% and 99% rather than the extremes: one collector pause would otherwise set a tail).
RATIOS_KEPT = 2000
SPREAD_QUANTILES = (0.01, 0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 0.99)


@dataclass(slots=True)
class StepTimeRecorder:
    """An engine's own step-time profile under whatever load it serves, for capacity planning: a slowly forgetting
    :class:`StepTimeModel`, and how far steps strayed from it (each step's time over the model's prediction made
    before it), whatever the scheduler. The engine calls :meth:`observe` at every ``schedule()``."""

    model: StepTimeModel = field(default_factory=lambda: StepTimeModel(RECORDER_FORGET, RECORDER_MIN_SAMPLES))
    ratios: deque[float] = field(default_factory=lambda: deque(maxlen=RATIOS_KEPT))
    _last_s: float | None = None
    _last_tokens: int = 0

    def observe(self, now_s: float, num_tokens: int) -> None:
        """A schedule at ``now_s`` that computes ``num_tokens``; the gap since the last one is that step's time
        when the last one computed tokens too (after an empty one the gap includes waiting for work)."""
        if self._last_s is not None and self._last_tokens:
            seconds = now_s - self._last_s
            if self.model.ready:
                predicted = self.model.predict(self._last_tokens)
                if predicted > 0:
                    self.ratios.append(seconds / predicted)
            self.model.observe(self._last_tokens, seconds)
        self._last_s, self._last_tokens = now_s, num_tokens

    @property
    def ready(self) -> bool:
        return self.model.ready and len(self.ratios) >= RECORDER_MIN_SAMPLES

    def spread(self) -> tuple[float, ...]:
        """The ratios' quantiles at :data:`SPREAD_QUANTILES`."""
        ordered = sorted(self.ratios)
        if not ordered:
            return ()
        return tuple(ordered[min(int(q * len(ordered)), len(ordered) - 1)] for q in SPREAD_QUANTILES)


def draw_ratio(spread: tuple[float, ...], u: float) -> float:
    """A step-time ratio for ``u`` uniform in [0, 1) from quantiles at :data:`SPREAD_QUANTILES`: linear between
    them, held at the outer ones beyond (1.0 without a spread)."""
    if not spread:
        return 1.0
    i = bisect.bisect_left(SPREAD_QUANTILES, u)
    if i == 0:
        return spread[0]
    if i == len(SPREAD_QUANTILES):
        return spread[-1]
    lo, hi = SPREAD_QUANTILES[i - 1], SPREAD_QUANTILES[i]
    return spread[i - 1] + (spread[i] - spread[i - 1]) * (u - lo) / (hi - lo)
