"""Embeddings for a tenant: its limits taken, an admission slot held, computed on the engine thread between two
steps within the request timeout."""

from __future__ import annotations

import asyncio

from rtxcore.server.serving.generation import overloaded, timed_out
from rtxcore.server.serving.runtime import ServingRuntime
from rtxcore.server.serving.tenants import RateLimited, Tenant


async def embed(runtime: ServingRuntime, tenant: Tenant | None, token_lists: list[list[int]],
                param: str = "input") -> list[list[float]]:
    """:raises RequestError: RESOURCE_EXHAUSTED (tenant limit or server full), INVALID_ARGUMENT (an input does not
    fit, naming ``param``), DEADLINE_EXCEEDED."""
    engine = runtime.engine()
    num_tokens = sum(len(t) for t in token_lists)
    try:
        lease = runtime.tenants.acquire(tenant, 1, num_tokens, tokens_param=param, tokens_what="inputs")
    except RateLimited as exc:
        runtime.metrics.record_rejection(exc.limit, tenant=tenant.name if tenant is not None else None)
        raise
    if not runtime.try_admit(1):
        runtime.tenants.release(lease, 0)
        runtime.metrics.record_rejection("overloaded")
        raise overloaded(runtime.settings.max_active_requests)
    try:
        async with asyncio.timeout(runtime.settings.request_timeout_s):
            return await engine.embed(token_lists, param)
    except TimeoutError:
        runtime.metrics.record_timeout()
        raise timed_out(runtime.settings.request_timeout_s) from None
    finally:
        runtime.release(1)
        runtime.tenants.release(lease, num_tokens)
