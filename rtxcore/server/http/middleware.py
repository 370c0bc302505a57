"""What every HTTP request goes through: a request id, W3C trace context, the body-size limit and an access log.

Written as plain ASGI (not ``BaseHTTPMiddleware``) so that streaming responses and client disconnects pass through
untouched.
"""

from __future__ import annotations

import json
import logging
import re
import secrets
import time
from dataclasses import dataclass

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from rtxcore.metrics.timeline import kept_tracestate
from rtxcore.server.http.dashboard_routes import PATHS as DASHBOARD_PATHS
from rtxcore.server.http.errors import APIError

log = logging.getLogger("rtx.http")

REQUEST_ID_HEADER = "x-request-id"
_REQUEST_ID_MAX_LEN = 64
_REQUEST_ID_UNSAFE = re.compile(r"[^A-Za-z0-9._:-]")
_TRACEPARENT = re.compile(r"^([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})(-.*)?$")
# Probes are polled often; their access lines go to DEBUG.
_QUIET_PATHS = frozenset({"/health", "/ready", "/metrics", *DASHBOARD_PATHS})


def loggable(text: str) -> str:
    """``text`` with control characters escaped: a path is percent-decoded, and ``%0a`` in it must not start a forged
    line of the log."""
    return text if text.isprintable() else "".join(c if c.isprintable() else ascii(c)[1:-1] for c in text)


@dataclass(slots=True, frozen=True)
class TraceContext:
    """This server's span in a W3C trace: the caller's trace id (or a new one) and a new span id."""

    trace_id: str
    # The caller's span, None when the request came without a valid ``traceparent``.
    parent_id: str | None
    span_id: str
    flags: str
    # The caller's ``tracestate``, passed on with its trace; None without a parent or when out of bounds.
    tracestate: str | None = None

    @classmethod
    def from_headers(cls, traceparent: str | None, tracestate: str | None = None) -> TraceContext:
        parsed = parse_traceparent(traceparent)
        if parsed is None:
            return cls(secrets.token_hex(16), None, secrets.token_hex(8), "00")
        trace_id, parent_id, flags = parsed
        return cls(trace_id, parent_id, secrets.token_hex(8), flags, kept_tracestate(tracestate))

    @property
    def traceparent(self) -> str:
        """The header to send on: same trace, this server's span as the parent."""
        return f"00-{self.trace_id}-{self.span_id}-{self.flags}"


def parse_traceparent(value: str | None) -> tuple[str, str, str] | None:
    """``(trace_id, parent_id, flags)`` of a valid W3C ``traceparent`` header, else None."""
    if not value:
        return None
    match = _TRACEPARENT.match(value.strip().lower())
    if match is None:
        return None
    version, trace_id, parent_id, flags, rest = match.groups()
    if version == "ff" or (version == "00" and rest) or set(trace_id) == {"0"} or set(parent_id) == {"0"}:
        return None
    return trace_id, parent_id, flags


def sanitize_request_id(value: str | None) -> str:
    """The client's request id made safe for headers, logs and engine ids; a fresh one when it has none."""
    cleaned = _REQUEST_ID_UNSAFE.sub("", value or "")[:_REQUEST_ID_MAX_LEN]
    return cleaned or secrets.token_hex(12)


class RequestContextMiddleware:
    def __init__(self, app: ASGIApp, max_body_bytes: int):
        self.app = app
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.monotonic()
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        request_id = sanitize_request_id(headers.get(REQUEST_ID_HEADER))
        trace = TraceContext.from_headers(headers.get("traceparent"), headers.get("tracestate"))
        # received_at: where a request's time on the serving side starts (rtxcore.capacity.serving_path).
        scope["state"] = {**scope.get("state", {}), "request_id": request_id, "trace": trace, "received_at": start}
        extra = [(REQUEST_ID_HEADER.encode(), request_id.encode()), (b"traceparent", trace.traceparent.encode())]
        if trace.tracestate is not None:
            extra.append((b"tracestate", trace.tracestate.encode("latin-1")))
        status = 0

        async def send_with_headers(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                message = {**message, "headers": [*message.get("headers", []), *extra]}
            await send(message)

        try:
            declared = int(headers.get("content-length", "0"))
        except ValueError:
            declared = 0
        try:
            if declared > self.max_body_bytes:
                await send_error(send_with_headers, self._too_large())
            else:
                await self.app(scope, self._limited(receive), send_with_headers)
        except Exception:  # a bug: log it, answer 500 if we still can, keep serving
            log.exception("unhandled error in %s %s (request_id=%s)", scope["method"], loggable(scope["path"]),
                          request_id)
            if status == 0:
                await send_error(send_with_headers, APIError(500, "internal server error; see the server log"))
        finally:
            path = loggable(scope["path"])
            level = logging.DEBUG if path in _QUIET_PATHS and status < 500 else logging.INFO
            log.log(level, "%s %s %s %.3fs request_id=%s trace_id=%s parent_id=%s", scope["method"], path,
                    status or "-", time.monotonic() - start, request_id, trace.trace_id, trace.parent_id or "-")

    def _too_large(self) -> APIError:
        return APIError(413, f"request body is larger than the limit of {self.max_body_bytes} bytes", param=None)

    def _limited(self, receive: Receive) -> Receive:
        """``receive`` that counts body bytes as they arrive, so a chunked body cannot slip past the limit."""
        received = 0

        async def limited_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_body_bytes:
                    raise self._too_large()
            return message

        return limited_receive


async def send_error(send: Send, error: APIError) -> None:
    body = json.dumps(error.body()).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
               (b"connection", b"close")]
    headers += [(k.lower().encode(), v.encode()) for k, v in error.headers.items()]
    await send({"type": "http.response.start", "status": error.status, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})
