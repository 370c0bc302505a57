"""Percentiles and rounding shared by the per-request and per-lane figures."""

from __future__ import annotations

import math


def percentile(values: list[float], q: float) -> float | None:
    """The ``q``-th percentile (0-100), linear between the closest ranks (numpy's default); None when empty."""
    if not values:
        return None
    ordered = sorted(values)
    position = (len(ordered) - 1) * q / 100
    below = math.floor(position)
    above = min(below + 1, len(ordered) - 1)
    return ordered[below] + (ordered[above] - ordered[below]) * (position - below)


def rounded(value: float | None) -> float | None:
    return None if value is None else round(value, 6)
