"""Helpers every route uses: the JSON body, the model name check, the request id, the route (tenant, lane, cache
salt), token text."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from starlette.requests import Request

from rtxcore.engine.outputs import TokenLogprob
from rtxcore.errors import InvalidRequestError
from rtxcore.lanes import DEFAULT_LANE, check_lane_name
from rtxcore.metrics.timeline import TraceHeaders
from rtxcore.server.http.errors import APIError
from rtxcore.server.http.protocol import RoutingFields
from rtxcore.server.runtime import ServingRuntime
from rtxcore.server.tenants import NotEntitled, Tenant, cache_salt
from rtxcore.tokenizer import Tokenizer

# Names a request's lane, as the body's "lane" field does.
LANE_HEADER = "x-rtx-lane"


@dataclass(slots=True, frozen=True)
class Route:
    """Who a request is for and where it runs."""

    tenant: Tenant | None
    lane: str
    # Tenant and request salt combined (rtxcore.server.tenants.cache_salt).
    cache_salt: str | None

    @property
    def tenant_name(self) -> str | None:
        return self.tenant.name if self.tenant is not None else None


def tenant_name(request: Request) -> str | None:
    """The authenticated tenant's name, None on a server without API keys."""
    tenant = request.state.tenant
    return tenant.name if tenant is not None else None


def route(runtime: ServingRuntime, request: Request, fields: RoutingFields) -> Route:
    """The request's route: 400 for an unknown or conflicting lane, 403 for a lane its tenant may not use."""
    tenant = request.state.tenant
    header = request.headers.get(LANE_HEADER)
    if header is not None:
        check_lane_name(header.strip(), param=LANE_HEADER)
        header = header.strip()
        if fields.lane is not None and fields.lane != header:
            raise InvalidRequestError(f"lane {fields.lane!r} in the body contradicts {LANE_HEADER}: {header}",
                                      param="lane")
    lane = fields.lane or header
    if tenant is not None:
        try:
            lane = tenant.lane_for(lane)
        except NotEntitled as exc:
            runtime.metrics.record_rejection("not_entitled", lane=lane, tenant=tenant.name)
            raise APIError(403, str(exc), param="lane") from None
    return Route(tenant, lane or DEFAULT_LANE, cache_salt(tenant, fields.cache_salt))


async def read_json(request: Request) -> dict[str, Any]:
    """The body as a JSON object: 422 when it is not JSON at all, 400 when it is JSON but not an object."""
    body = await request.body()
    try:
        data = json.loads(body)
    except (ValueError, RecursionError):  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise APIError(422, "request body is not valid JSON") from None
    if not isinstance(data, dict):
        raise APIError(400, f"request body must be a JSON object, got {type(data).__name__}")
    return data


def check_model(runtime: ServingRuntime, model: str | None) -> None:
    """404 for a model this server does not serve; no model at all means the served one."""
    if model is not None and model not in runtime.model_aliases:
        raise APIError(404, f"model {model!r} does not exist; this server serves {runtime.model_name!r}",
                       param="model", code="model_not_found")


def request_id(request: Request) -> str:
    return request.state.request_id


def trace_headers(request: Request) -> TraceHeaders:
    """This server's ``traceparent`` (the one sent back) and the caller's ``tracestate``, under which engine
    requests are traced."""
    trace = request.state.trace
    return TraceHeaders(trace.traceparent, trace.tracestate)


def token_text(tokenizer: Tokenizer | None, token_id: int) -> str:
    """How a token reads in logprobs; ``token_id:N`` for models without a tokenizer (as vLLM spells it)."""
    if tokenizer is None:
        return f"token_id:{token_id}"
    return tokenizer.decode([token_id], skip_special_tokens=False)


def native_logprobs(logprobs: list[TokenLogprob]) -> list[dict[str, Any]]:
    return [{"token_id": lp.token_id, "logprob": lp.logprob, "top": [[t, p] for t, p in lp.top]} for lp in logprobs]
