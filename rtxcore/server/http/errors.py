"""Errors as HTTP responses, in OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}``.

A :class:`RequestError` from the serving core maps to its status here, in one table; :class:`APIError` is for what
only HTTP can get wrong (a body that is not JSON, a route that does not exist). Anything else is a bug, answered
with a 500 that carries no traceback (the traceback goes to the log).
"""

from __future__ import annotations

import json
import math

from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response

from rtxcore.errors import ErrorCode, RequestError
from rtxcore.server.serving.formats import openai_error_body

STATUS = {
    ErrorCode.INVALID_ARGUMENT: 400,
    ErrorCode.UNAUTHENTICATED: 401,
    ErrorCode.PERMISSION_DENIED: 403,
    ErrorCode.NOT_FOUND: 404,
    ErrorCode.CONFLICT: 422,
    ErrorCode.FAILED_PRECONDITION: 400,
    ErrorCode.OUT_OF_RANGE: 400,
    ErrorCode.RESOURCE_EXHAUSTED: 429,
    ErrorCode.UNAVAILABLE: 503,
    ErrorCode.DEADLINE_EXCEEDED: 504,
    # nginx's "client closed request": what the client asked for, no failure of the server.
    ErrorCode.CANCELLED: 499,
    ErrorCode.INTERNAL: 500,
}
# OpenAI's ``type`` for the HTTP-only errors.
_TYPES = {404: "not_found_error", 405: "invalid_request_error", 413: "invalid_request_error", 500: "server_error"}
_CODES = {404: "not_found", 405: "method_not_allowed", 413: "request_too_large", 500: "internal_error"}


def status_of(err: RequestError) -> int:
    return STATUS[err.code]


def headers_of(err: RequestError) -> dict[str, str]:
    """``Retry-After`` in whole seconds, rounded up so that a client that waits it is not refused early."""
    if err.retry_after_s is None:
        return {}
    return {"Retry-After": str(max(1, math.ceil(err.retry_after_s)))}


def error_response(err: RequestError, headers: dict[str, str] | None = None) -> Response:
    return Response(json.dumps(openai_error_body(err)), status_code=status_of(err),
                    headers={**headers_of(err), **(headers or {})}, media_type="application/json")


class APIError(Exception):
    """An HTTP-only failure answered with ``status`` and an OpenAI-shaped JSON body."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code or _CODES.get(status)
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": _TYPES.get(self.status, "invalid_request_error"),
                          "param": self.param, "code": self.code}}

    def response(self) -> Response:
        return Response(json.dumps(self.body()), status_code=self.status, headers=self.headers,
                        media_type="application/json")


async def api_error_handler(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, APIError)
    return exc.response()


async def request_error_handler(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, RequestError)
    return error_response(exc)


async def http_exception_handler(request: Request, exc: Exception) -> Response:
    """Starlette's own errors (unknown route, wrong method) in the same JSON shape."""
    assert isinstance(exc, HTTPException)
    if exc.status_code == 404:
        message = f"no route {request.method} {request.url.path}"
    elif exc.status_code == 405:
        message = f"method {request.method} is not allowed on {request.url.path}"
    else:
        message = str(exc.detail)
    return APIError(exc.status_code, message, headers=dict(exc.headers or {})).response()
