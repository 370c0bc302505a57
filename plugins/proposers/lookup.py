"""Prompt lookup: the tokens that followed the latest earlier occurrence of a sequence's last n tokens."""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


def lookup_continuation(haystack: np.ndarray, suffix: np.ndarray, k: int, min_n: int, max_n: int,
                        exclude_tail: bool) -> list[int]:
    """Up to ``k`` tokens following the latest occurrence in ``haystack`` of the longest of ``suffix``'s last n
    tokens (n from ``max_n`` down to ``min_n``) that occurs there with at least one token after it.

    :param exclude_tail: ``suffix`` is the end of ``haystack`` itself, so its own (final) occurrence does not count.
    """
    for n in range(min(max_n, len(suffix)), min_n - 1, -1):
        pattern = suffix[-n:]
        # Occurrences must leave a token to propose after them (and, within the sequence itself, not be its end).
        limit = len(haystack) - n - (1 if exclude_tail else 0)
        if limit < 0:
            continue
        windows = sliding_window_view(haystack[:limit + n], n)
        # A first-token filter keeps the full comparison to a handful of candidates.
        starts = np.flatnonzero(windows[:, 0] == pattern[0])
        if n > 1 and len(starts):
            starts = starts[(windows[starts] == pattern).all(axis=1)]
        if len(starts):
            begin = int(starts[-1]) + n
            return haystack[begin:begin + k].tolist()
    return []
