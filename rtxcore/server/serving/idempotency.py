"""Idempotency keys: a repeat of a request (same key, same tenant) attaches to the request the key was first used
for, instead of starting another. Keys work only with a state dir (durable restarts); without one they are ignored,
as servers ignore headers they do not implement."""

from __future__ import annotations

from rtxcore.errors import ErrorCode, RequestError
from rtxcore.server.serving.runtime import ServingRuntime
from rtxcore.server.serving.served_request import IdempotencyClaim, ServedRequest


async def claim(runtime: ServingRuntime, tenant: str | None, key: str | None, fingerprint: str
                ) -> tuple[ServedRequest | None, IdempotencyClaim | None]:
    """``(request it was used for, None)`` for a repeated key, ``(None, claim)`` for a first use (the key is then
    reserved: the caller must begin the request or :func:`release` the key), ``(None, None)`` without a key.

    :param fingerprint: what makes two uses of a key the same request (a digest of the route and the body).
    :raises RequestError: CONFLICT for a key reused with another request.
    """
    durable = runtime.durable
    if durable is None or key is None:
        return None, None
    existing = await durable.find_key(tenant, key)
    if existing is not None:
        if existing.idempotency is not None and existing.idempotency.fingerprint != fingerprint:
            raise RequestError(ErrorCode.CONFLICT, "Idempotency-Key was already used with a different request "
                               "(route or body)", param="Idempotency-Key", reason="idempotency_key_reused")
        durable.stats.num_idempotent_replays += 1
        return existing, None
    durable.claim_key(tenant, key)
    return None, IdempotencyClaim(key, fingerprint)


def release(runtime: ServingRuntime, tenant: str | None, claim: IdempotencyClaim | None) -> None:
    """Free a claimed key whose request was refused, so that a retry with it can start."""
    if claim is not None and runtime.durable is not None:
        runtime.durable.release_key(tenant, claim.key)
