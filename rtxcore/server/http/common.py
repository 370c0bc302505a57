"""Helpers every route uses: the JSON body, the request id and trace, the tenant, the route (tenant, lane, cache
salt), and waiting for work while watching the client's connection."""

from __future__ import annotations

import asyncio
import json
from typing import Any, Awaitable, Callable, TypeVar

from starlette.requests import Request

from rtxcore.errors import InvalidRequestError
from rtxcore.lanes import check_lane_name
from rtxcore.metrics.timeline import TraceHeaders
from rtxcore.server.http.errors import APIError
from rtxcore.server.http.protocol import RoutingFields
from rtxcore.server.serving import strict_json
from rtxcore.server.serving.routing import Route, route
from rtxcore.server.serving.runtime import ServingRuntime
from rtxcore.server.serving.tenants import Tenant

T = TypeVar("T")

# Names a request's lane, as the body's "lane" field does.
LANE_HEADER = "x-rtx-lane"


# A parsed JSON value's type as JSON names it.
_JSON_TYPES = {list: "an array", str: "a string", int: "a number", float: "a number", bool: "a boolean",
               type(None): "null"}


class ClientGone(Exception):
    """The client disconnected before its response was ready."""


def tenant_of(request: Request) -> Tenant | None:
    """The authenticated tenant (set by the auth middleware), None on a server without API keys."""
    return request.state.tenant


def tenant_name(request: Request) -> str | None:
    tenant = tenant_of(request)
    return tenant.name if tenant is not None else None


def request_route(runtime: ServingRuntime, request: Request, fields: RoutingFields) -> Route:
    """The request's route from its body and its ``x-rtx-lane`` header: 400 for an unknown or conflicting lane,
    403 for a lane its tenant may not use."""
    header = request.headers.get(LANE_HEADER)
    if header is not None:
        header = check_lane_name(header.strip(), param=LANE_HEADER)
        if fields.lane is not None and fields.lane != header:
            raise InvalidRequestError(f"lane {fields.lane!r} in the body contradicts {LANE_HEADER}: {header}",
                                      param="lane")
    return route(runtime, tenant_of(request), fields.lane or header, fields.cache_salt)


async def read_json(request: Request) -> dict[str, Any]:
    """The body as a JSON object. 400 when it is not UTF-8 JSON (``code: invalid_json``, as OpenAI answers), not an
    object, or holds a string with a lone UTF-16 surrogate (``"\\ud800"`` is valid JSON but no text: no tokenizer
    takes it); 415 when it is compressed (a gzip body read as JSON was "not valid JSON", which misled)."""
    encoding = request.headers.get("content-encoding", "identity").strip().lower()
    if encoding not in ("", "identity"):
        raise APIError(415, f"Content-Encoding {encoding!r} is not supported: send the body uncompressed",
                       code="unsupported_media_type")
    body = await request.body()
    try:
        # Decoded strictly first: json.loads(bytes) would guess UTF-16 and let encoded surrogates through.
        data = strict_json.loads(body.decode("utf-8-sig"))
    except strict_json.NotJSONNumber as exc:
        raise APIError(400, f"request body is not valid JSON: {exc.args[0]} is not a JSON number",
                       code="invalid_json") from None
    except RecursionError:
        raise APIError(400, "request body is nested too deeply", code="invalid_json") from None
    except ValueError:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise APIError(400, "request body is not valid JSON", code="invalid_json") from None
    if not isinstance(data, dict):
        raise APIError(400, f"request body must be a JSON object, got {_JSON_TYPES[type(data)]}",
                       code="invalid_value")
    if b"\\u" in body and _has_lone_surrogate(data):  # in strict UTF-8, only an escape can put one in a string
        field = _lone_surrogate_at(data)
        if field is not None:
            raise APIError(400, f"{field} holds a lone UTF-16 surrogate: not valid Unicode text", param=field,
                           code="invalid_value")
    return data


def _has_lone_surrogate(data: dict[str, Any]) -> bool:
    """Whether any string of ``data`` cannot be encoded as UTF-8: one pass of json's C encoder, so that the walk
    naming the field (Python, several times slower) runs only for the bodies that have one."""
    try:
        json.dumps(data, ensure_ascii=False).encode("utf-8")
    # UnicodeEncodeError is a ValueError; a body nested past the encoder's depth is left to the walk as well.
    except (ValueError, RecursionError):
        return True
    return False


def _lone_surrogate_at(data: dict[str, Any]) -> str | None:
    """The path (``messages[0].content``) of the first string, key or value, that cannot be encoded as UTF-8.

    Walked with a stack, not by recursion: a body nested deeper than Python's recursion limit can still parse."""
    stack: list[tuple[str, Any]] = [("", data)]
    while stack:
        path, value = stack.pop()
        if isinstance(value, str):
            try:
                value.encode("utf-8")
            except UnicodeEncodeError:
                return path
        elif isinstance(value, dict):
            for key, item in reversed(value.items()):
                here = f"{path}.{ascii(key)[1:-1]}" if path else ascii(key)[1:-1]
                stack += [(here, item), (here, key)]
        elif isinstance(value, list):
            stack += [(f"{path}[{i}]", item) for i, item in reversed(list(enumerate(value)))]
    return None


def request_id(request: Request) -> str:
    return request.state.request_id


def received_at(request: Request) -> float | None:
    """When the server got the request (time.monotonic()), as the request middleware noted it."""
    return getattr(request.state, "received_at", None)


def trace_headers(request: Request) -> TraceHeaders:
    """This server's ``traceparent`` (the one sent back) and the caller's ``tracestate``, under which engine
    requests are traced."""
    trace = request.state.trace
    return TraceHeaders(trace.traceparent, trace.tracestate)


async def until_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Await ``work``, cancelling it if the client disconnects first.

    :raises ClientGone: the client went away (``work`` has been cancelled).
    """
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(_wait_for_disconnect(request.receive))
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not task.done():
            task.cancel()
    if not task.done() or task.cancelled():
        raise ClientGone()
    return task.result()


async def _wait_for_disconnect(receive: Callable) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass
