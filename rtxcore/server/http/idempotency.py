"""``Idempotency-Key`` on POST generations: a repeat of a request (same key, same tenant) attaches to the request
the key was first used for, instead of starting another. Keys work only with a state dir (durable restarts);
without one the header is ignored, as servers ignore headers they do not implement."""

from __future__ import annotations

import hashlib
import json
import re
from typing import Any

from starlette.requests import Request

from rtxcore.server.durable.entry import DurableRequest, IdempotencyClaim
from rtxcore.server.http.common import tenant_name
from rtxcore.server.http.errors import APIError
from rtxcore.server.runtime import ServingRuntime

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


async def claim(runtime: ServingRuntime, request: Request, body: dict[str, Any]
                ) -> tuple[DurableRequest | None, IdempotencyClaim | None]:
    """``(request it was used for, None)`` for a repeated key, ``(None, claim)`` for a first use (the key is then
    reserved: the caller must add the request or release the key), ``(None, None)`` without a key.

    :raises APIError: 400 for a malformed key, 422 for a key reused with another request.
    """
    durable = runtime.durable
    key = idempotency_key(request)
    if durable is None or key is None:
        return None, None
    tenant = tenant_name(request)
    digest = fingerprint(request, body)
    existing = await durable.find_key(tenant, key)
    if existing is not None:
        if existing.idempotency is not None and existing.idempotency.fingerprint != digest:
            raise APIError(422, "Idempotency-Key was already used with a different request (route or body)",
                           param="Idempotency-Key", code="idempotency_key_reused")
        return existing, None
    durable.claim_key(tenant, key)
    return None, IdempotencyClaim(key, digest)
