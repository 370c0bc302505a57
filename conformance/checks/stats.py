"""Chi-square goodness of fit without SciPy: Pearson's statistic and the Wilson-Hilferty critical value.

Wilson-Hilferty's cube-root normal approximation of the chi-square quantile is within a few percent of the exact value
for one degree of freedom and far closer above that, which is plenty for a pass/fail threshold whose false-failure
rate is stated as an order of magnitude.
"""

from __future__ import annotations

from dataclasses import dataclass
from statistics import NormalDist

# Bins expected to hold fewer draws than this are merged, as the chi-square approximation requires.
MIN_EXPECTED = 5.0


@dataclass(frozen=True, slots=True)
class FitResult:
    statistic: float
    critical: float
    degrees_of_freedom: int
    # Draws of tokens the target gives probability 0.
    impossible_draws: int

    @property
    def passed(self) -> bool:
        return self.impossible_draws == 0 and self.statistic <= self.critical


def chi_square_critical(degrees_of_freedom: int, alpha: float) -> float:
    """The value a chi-square variable exceeds with probability ``alpha``."""
    k = degrees_of_freedom
    z = NormalDist().inv_cdf(1 - alpha)
    return k * (1 - 2 / (9 * k) + z * (2 / (9 * k)) ** 0.5) ** 3


def goodness_of_fit(counts: list[int], probs: list[float], alpha: float) -> FitResult:
    """Test observed ``counts`` per token against target ``probs`` (same length)."""
    total = sum(counts)
    impossible = sum(c for c, p in zip(counts, probs) if p <= 0)
    bins: list[tuple[float, float]] = []  # (observed, expected)
    small_obs = small_exp = 0.0
    for count, p in zip(counts, probs):
        if p <= 0:
            continue
        expected = p * total
        if expected < MIN_EXPECTED:
            small_obs += count
            small_exp += expected
        else:
            bins.append((count, expected))
    if small_exp > 0:
        bins.append((small_obs, small_exp))
    if len(bins) < 2:
        return FitResult(0.0, 0.0, 0, impossible)
    statistic = sum((o - e) ** 2 / e for o, e in bins)
    dof = len(bins) - 1
    return FitResult(statistic, chi_square_critical(dof, alpha), dof, impossible)
