"""Errors as HTTP responses, in OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}``.

Every failure a route can meet is an :class:`APIError` by the time it reaches the client; anything else is a bug,
answered with a 500 that carries no traceback (the traceback goes to the log).
"""

from __future__ import annotations

import json
import math

from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response

from rtxcore.errors import InvalidRequestError

# The ``type`` OpenAI's clients see for each status; ``code`` says more precisely what happened.
_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "service_unavailable_error",
    504: "timeout_error",
}
_CODES = {401: "invalid_api_key", 403: "not_entitled", 404: "not_found", 405: "method_not_allowed", 413: "request_too_large", 422: "invalid_json",
          429: "server_overloaded", 500: "internal_error", 503: "not_ready", 504: "timeout"}

# Seconds a client is told to wait before retrying a 429 or a 503.
RETRY_AFTER_S = 1


class APIError(Exception):
    """An error answered with ``status`` and an OpenAI-shaped JSON body."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code or _CODES.get(status)
        self.headers = headers or {}

    @classmethod
    def invalid(cls, exc: InvalidRequestError) -> APIError:
        return cls(400, str(exc), param=exc.param, code="invalid_value")

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": _TYPES.get(self.status, "server_error"),
                          "param": self.param, "code": self.code}}

    def response(self) -> Response:
        return Response(json.dumps(self.body()), status_code=self.status, headers=self.headers,
                        media_type="application/json")


def not_ready(reason: str) -> APIError:
    return APIError(503, reason, headers={"Retry-After": str(RETRY_AFTER_S)})


def overloaded(num_active: int) -> APIError:
    return APIError(429, f"the server is at its limit of {num_active} active requests; retry later",
                    headers={"Retry-After": str(RETRY_AFTER_S)})


def too_many_requests(message: str, retry_after_s: float, code: str) -> APIError:
    """429 with ``Retry-After`` in whole seconds, rounded up so a client that waits it is not refused early."""
    return APIError(429, message, code=code, headers={"Retry-After": str(max(1, math.ceil(retry_after_s)))})


async def api_error_handler(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, APIError)
    return exc.response()


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
