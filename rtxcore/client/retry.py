"""The one retry policy every client uses: bounded attempts, the server's ``Retry-After`` when it gives one,
exponential backoff with jitter when it does not.

Only answers that mean "try again later" are retried: HTTP 429 and 503, gRPC UNAVAILABLE and RESOURCE_EXHAUSTED
with a ``retry-after``.
A streaming call is retried only before its first event arrives, so nothing is ever delivered twice; the gRPC
clients also go on after that point, but only from a server's journal, after the last event received
(:mod:`rtxcore.client.grpc`).
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass
from email.utils import parsedate_to_datetime

from rtxcore.client.errors import APIError

RETRYABLE_HTTP_STATUSES = frozenset({429, 503})
RETRYABLE_GRPC_CODES = frozenset({"RESOURCE_EXHAUSTED", "UNAVAILABLE"})


@dataclass(slots=True, frozen=True)
class RetryPolicy:
    # Attempts in all, the first included; 1 disables retries.
    max_attempts: int = 3
    # First wait when the server gives no Retry-After; doubles with each attempt up to max_backoff_s.
    backoff_s: float = 0.5
    max_backoff_s: float = 8.0
    # A server asking for a longer wait than this is not waited for: the error is raised at once.
    max_retry_after_s: float = 60.0
    # How long a journaled stream cut after it started keeps trying to resume (the server restarting, say), in
    # seconds from the cut; attempts are not counted there (rtxcore.client.grpc).
    max_resume_wait_s: float = 300.0

    def __post_init__(self) -> None:
        if not isinstance(self.max_attempts, int) or self.max_attempts < 1:
            raise ValueError(f"max_attempts must be an integer >= 1, got {self.max_attempts!r}")
        for name in ("backoff_s", "max_backoff_s", "max_retry_after_s", "max_resume_wait_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")

    def delay(self, attempt: int, error: APIError) -> float | None:
        """Seconds to wait before trying again after ``error`` ended attempt number ``attempt`` (1-based), or None
        to give up and raise it."""
        if attempt >= self.max_attempts or not is_retryable(error):
            return None
        if error.retry_after is not None:
            return error.retry_after if error.retry_after <= self.max_retry_after_s else None
        backoff = min(self.backoff_s * 2 ** (attempt - 1), self.max_backoff_s)
        return backoff * random.uniform(0.5, 1.0)


NO_RETRY = RetryPolicy(max_attempts=1)


def is_retryable(error: APIError) -> bool:
    if error.status is not None:
        return error.status in RETRYABLE_HTTP_STATUSES
    if error.code == "RESOURCE_EXHAUSTED":
        # The server's own (a full queue, a rate limit) always say when to come back; gRPC's library answers a
        # message over its size limit with the same code and no retry-after, and that would fail again.
        return error.retry_after is not None
    return error.code in RETRYABLE_GRPC_CODES


def parse_retry_after(value: str | None, now: float | None = None) -> float | None:
    """Seconds from a ``Retry-After`` value: delay-seconds or an HTTP date (RFC 9110 10.2.3); None if absent or
    unreadable."""
    if value is None:
        return None
    value = value.strip()
    try:
        seconds = float(value)
    except ValueError:
        try:
            when = parsedate_to_datetime(value)
        except (TypeError, ValueError):
            return None
        seconds = when.timestamp() - (time.time() if now is None else now)
    return max(0.0, seconds) if seconds == seconds else None  # NaN is unreadable
