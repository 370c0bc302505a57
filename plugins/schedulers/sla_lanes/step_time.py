"""How long an engine step takes as a function of the tokens it computes, learnt from the steps themselves.

A step costs a fixed part (weights read once, launch and host overhead) plus a part per token; the model
``seconds = base + per_token * tokens`` is fitted by least squares with exponential forgetting, so it follows the
machine as load, batch shapes and contention change. The scheduler feeds it the gap between two back-to-back
``schedule()`` calls, which is the duration of the step between them.
"""

from __future__ import annotations

from dataclasses import dataclass


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
