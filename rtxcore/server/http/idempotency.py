"""``Idempotency-Key`` on POST generations: the header read and checked, and what makes two uses of a key the same
request (the route and the body); the claim itself is the serving core's (``serving.idempotency``)."""

from __future__ import annotations

import hashlib
import json
import re
from typing import Any

from starlette.requests import Request

from rtxcore.server.http.errors import APIError

IDEMPOTENCY_HEADER = "idempotency-key"
_KEY = re.compile(r"^[\x21-\x7e]{1,255}$")


def idempotency_key(request: Request) -> str | None:
    """The request's key: 400 unless it is 1-255 visible ASCII characters."""
    key = request.headers.get(IDEMPOTENCY_HEADER)
    if key is None:
        return None
    if not _KEY.match(key):
        raise APIError(400, "Idempotency-Key must be 1-255 visible ASCII characters", param="Idempotency-Key",
                       code="invalid_value")
    return key


def fingerprint(request: Request, body: dict[str, Any]) -> str:
    """What makes two uses of a key the same request: the route and the body (key order and spacing aside)."""
    canonical = json.dumps([request.url.path, body], sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return hashlib.sha256(canonical.encode()).hexdigest()
