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
from collections.abc import Callable, Iterable
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
# Steps kept for the spread (per kind of step), and the quantiles exported of their ratios to the profile (1% and
# 99% rather than the extremes: one collector pause would otherwise set a tail).
STEPS_KEPT = 2000
SPREAD_QUANTILES = (0.01, 0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 0.99)
# Decode steps of one batch size seen before that size's own mean stands in for the line.
DECODE_MIN_SAMPLES = 20


def is_decode(num_tokens: int, num_rows: int) -> bool:
    """Whether a step of ``num_tokens`` for ``num_rows`` requests is a decode: one token per request."""
    return num_rows > 0 and num_tokens == num_rows


# The kinds of step whose spreads are kept apart: decodes, predicted by their batch size's own mean, and steps with
# a prefill chunk, predicted by the line through the mix. At half load on 2 cores (W5, benchmarks/
# queueing_validation.py) decodes' ratios ran 0.87-1.51 (1% to 99%), the others' 0.71-1.39: one spread for both
# would draw the line's misses for decodes too.
DECODE, OTHER = "decode", "other"
STEP_KINDS = (DECODE, OTHER)


def step_kind(num_tokens: int, num_rows: int) -> str:
    return DECODE if is_decode(num_tokens, num_rows) else OTHER


class DecodeTimes:
    """Decode steps' time per batch size (one token per request), each size's mean with exponential forgetting.

    A line through all steps misses them: on 2 cores a decode of 1 to 3 requests took 0.65-0.72 of what the line
    fitted on the load's mix of decodes and prefill chunks said, 4 to 6 requests 0.93, 7 and more 1.0 (the matrix
    products change kernels with the batch; W5 at 0.5x load, 1,575 decode steps), and at half load most steps are
    such small decodes, which is the inter-token latency."""

    def __init__(self, forget: float):
        self.forget = forget
        # Per batch size: weighted sum of seconds, total weight, samples.
        self._sums: dict[int, list[float]] = {}

    def observe(self, rows: int, seconds: float) -> None:
        entry = self._sums.setdefault(rows, [0.0, 0.0, 0.0])
        keep = 1.0 - self.forget
        entry[0] = keep * entry[0] + seconds
        entry[1] = keep * entry[1] + 1.0
        entry[2] += 1

    def get(self, rows: int) -> float | None:
        """The mean decode time of ``rows`` requests, or None before DECODE_MIN_SAMPLES of them."""
        entry = self._sums.get(rows)
        return entry[0] / entry[1] if entry is not None and entry[2] >= DECODE_MIN_SAMPLES else None

    def seconds(self) -> dict[int, float]:
        """Every batch size's mean that stands, by size."""
        return {rows: s for rows in sorted(self._sums) if (s := self.get(rows)) is not None}


class RowCostFit:
    """``seconds = base + per_row * rows + per_token * tokens`` by least squares with exponential forgetting: a step's
    requests each cost output work (sampling, detokenizing, the outputs' trip to the servers, which on a small host
    compete with the engine's thread) that its token count alone does not show, since a decode row is one token and
    a prefill chunk many. Solved every ``SOLVE_EVERY`` samples (a 3x3 system), so a step pays a few additions."""

    SOLVE_EVERY = 16

    def __init__(self, forget: float):
        self.forget = forget
        self.num_samples = 0
        # Weighted sums of x x^T (upper triangle) and x y for x = (1, rows, tokens).
        self._xx = [0.0] * 6
        self._xy = [0.0] * 3
        self._solved: tuple[float, float, float] | None = None

    def observe(self, rows: int, tokens: int, seconds: float) -> None:
        keep = 1.0 - self.forget
        x = (1.0, float(rows), float(tokens))
        k = 0
        for i in range(3):
            self._xy[i] = keep * self._xy[i] + x[i] * seconds
            for j in range(i, 3):
                self._xx[k] = keep * self._xx[k] + x[i] * x[j]
                k += 1
        self.num_samples += 1
        if self.num_samples % self.SOLVE_EVERY == 0:
            self._solved = self._solve()

    def coefficients(self) -> tuple[float, float, float] | None:
        """``(base_s, per_row_s, per_token_s)``, all >= 0, or None when the samples do not separate rows from
        tokens (every step the same shape) or the fit is not all non-negative."""
        return self._solved

    def _solve(self) -> tuple[float, float, float] | None:
        import numpy as np

        a, b, c, d, e, f = self._xx
        matrix = np.array([[a, b, c], [b, d, e], [c, e, f]])
        if np.linalg.cond(matrix) > 1e12:
            return None
        base, per_row, per_token = (float(v) for v in np.linalg.solve(matrix, np.array(self._xy)))
        if min(base, per_row, per_token) < 0:
            return None
        return base, per_row, per_token


@dataclass(slots=True)
class StepTimeRecorder:
    """An engine's own step-time profile under whatever load it serves, for capacity planning: a slowly forgetting
    fit of each step's time on its requests and tokens (:class:`RowCostFit`; where it cannot separate them, a
    :class:`StepTimeModel` on tokens alone), and how far steps strayed from it (recent steps' time over what the
    profile says now, per kind of step: :data:`STEP_KINDS`), whatever the scheduler. The engine calls :meth:`observe`
    at every ``schedule()``."""

    model: StepTimeModel = field(default_factory=lambda: StepTimeModel(RECORDER_FORGET, RECORDER_MIN_SAMPLES))
    rows_fit: RowCostFit = field(default_factory=lambda: RowCostFit(RECORDER_FORGET))
    decodes: DecodeTimes = field(default_factory=lambda: DecodeTimes(RECORDER_FORGET))
    # The last STEPS_KEPT steps of each kind, (tokens, rows, seconds): their spread is taken against the profile
    # when it is read, not against the prediction each step had when it ran (see spread()).
    recent: dict[str, deque[tuple[int, int, float]]] = field(
        default_factory=lambda: {kind: deque(maxlen=STEPS_KEPT) for kind in STEP_KINDS})
    _last_s: float | None = None
    _last_tokens: int = 0
    _last_rows: int = 0

    def observe(self, now_s: float, num_tokens: int, num_rows: int = 0) -> None:
        """A schedule at ``now_s`` that computes ``num_tokens`` for ``num_rows`` requests; the gap since the last
        one is that step's time when the last one computed tokens too (after an empty one the gap includes waiting
        for work)."""
        if self._last_s is not None and self._last_tokens:
            seconds = now_s - self._last_s
            kind = step_kind(self._last_tokens, self._last_rows)
            self.recent[kind].append((self._last_tokens, self._last_rows, seconds))
            self.model.observe(self._last_tokens, seconds)
            if is_decode(self._last_tokens, self._last_rows):
                self.decodes.observe(self._last_rows, seconds)
            else:
                # The line is fitted on the steps it predicts: decodes have their batch size's own mean. Fitted on
                # every step (seven in ten decodes at 0.8x load on 2 cores), it put too much on each request: the
                # prefill steps of 16 requests ran at 0.97 of it, those of 1 to 3 at 1.12.
                self.rows_fit.observe(self._last_rows, self._last_tokens, seconds)
        self._last_s, self._last_tokens, self._last_rows = now_s, num_tokens, num_rows

    def coefficients(self) -> tuple[float, float, float]:
        """``(base_s, per_row_s, per_token_s)``: the row-aware fit where it holds, else tokens alone (no per-row
        part)."""
        fitted = self.rows_fit.coefficients()
        if fitted is not None:
            return fitted
        base, per_token = self.model.coefficients()
        return base, 0.0, per_token

    def predict(self, num_tokens: int, num_rows: int) -> float:
        """A decode step's batch size's own mean once it has one (DecodeTimes), else the line."""
        return self._predictor()(num_tokens, num_rows)

    def _predictor(self) -> Callable[[int, int], float]:
        """predict() with the profile's parts read once, for many steps at a time."""
        decode_s = self.decodes.seconds()
        base, per_row, per_token = self.coefficients()

        def predict(num_tokens: int, num_rows: int) -> float:
            decode = decode_s.get(num_rows) if is_decode(num_tokens, num_rows) else None
            return decode if decode is not None else base + per_row * num_rows + per_token * num_tokens
        return predict

    @property
    def ready(self) -> bool:
        return self.model.ready and sum(map(len, self.recent.values())) >= RECORDER_MIN_SAMPLES

    def spread(self, kind: str | None = None) -> tuple[float, ...]:
        """Quantiles at :data:`SPREAD_QUANTILES` of recent steps' time over what the profile predicts for them now:
        one kind of step's (empty before RECORDER_MIN_SAMPLES of them), or with ``None`` every step's.

        Against the profile as it stands, because that is what a simulation multiplies the drawn ratio by. Taken
        against each step's prediction when it ran, the ratios also held how far those predictions were from
        today's: at 0.8x load on 2 cores (W5) their draws averaged 0.97 of the profile where the same steps
        averaged 1.00, and the simulation ran its steps that much faster, thinner and more of them (1,723 against
        the live server's 1,655 on the same requests), its time to first token 7-11% short."""
        kinds = STEP_KINDS if kind is None else (kind,)
        steps = [step for k in kinds for step in self.recent[k]]
        if kind is not None and len(steps) < RECORDER_MIN_SAMPLES:
            return ()
        # A few thousand steps, once a second on the engine's thread: the profile's parts are read once for all.
        predict = self._predictor()
        predicted = [(seconds, predict(tokens, rows)) for tokens, rows, seconds in steps]
        return sample_quantiles(seconds / p for seconds, p in predicted if p > 0)


def sample_quantiles(values: Iterable[float]) -> tuple[float, ...]:
    """The values' quantiles at :data:`SPREAD_QUANTILES` (nearest rank below); empty without values."""
    ordered = sorted(values)
    if not ordered:
        return ()
    return tuple(_at_rank(ordered, q) for q in SPREAD_QUANTILES)


def nearest_rank(values: Iterable[float], q: float) -> float:
    """The values' quantile ``q`` (0-1), nearest rank below; nan without values."""
    ordered = sorted(values)
    return _at_rank(ordered, q) if ordered else float("nan")


def _at_rank(ordered: list[float], q: float) -> float:
    return ordered[min(int(q * len(ordered)), len(ordered) - 1)]


def draw_ratio(spread: tuple[float, ...], u: float) -> float:
    """A step-time ratio for ``u`` uniform in [0, 1) from quantiles at :data:`SPREAD_QUANTILES`: linear between
    them, held at the outer ones beyond (1.0 without a spread)."""
    return draw_quantile(spread, u, 1.0)


def draw_quantile(quantiles: tuple[float, ...], u: float, default: float) -> float:
    """A value for ``u`` uniform in [0, 1) from its quantiles at :data:`SPREAD_QUANTILES`: linear between them, held
    at the outer ones beyond; ``default`` without any."""
    if not quantiles:
        return default
    i = bisect.bisect_left(SPREAD_QUANTILES, u)
    if i == 0:
        return quantiles[0]
    if i == len(SPREAD_QUANTILES):
        return quantiles[-1]
    lo, hi = SPREAD_QUANTILES[i - 1], SPREAD_QUANTILES[i]
    return quantiles[i - 1] + (quantiles[i] - quantiles[i - 1]) * (u - lo) / (hi - lo)
