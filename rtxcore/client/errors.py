"""Errors the clients raise, the same for HTTP and gRPC."""

from __future__ import annotations

from rtxcore.errors import RtxError


class APIError(RtxError):
    """The server refused or failed a request.

    ``status`` is the HTTP status (None over gRPC); ``code`` the gRPC status name, or an HTTP error body's ``code``
    (``rate_limited``, ``queue_full``, ``invalid_api_key``...; its ``type`` when it has none); ``type`` that body's
    OpenAI error type (``invalid_request_error``, ``rate_limit_error``...; None over gRPC); ``param`` the offending
    field when the server named one, ``retry_after`` the seconds the server asked the client to wait (None when it
    did not say).
    """

    def __init__(self, message: str, *, status: int | None = None, code: str | None = None,
                 param: str | None = None, retry_after: float | None = None, type: str | None = None):
        super().__init__(message)
        self.message = message
        self.status = status
        self.code = code
        self.type = type
        self.param = param
        self.retry_after = retry_after

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.message!r}, status={self.status}, code={self.code!r})"


class APIConnectionError(APIError):
    """The server could not be reached or the connection broke."""


class APITimeoutError(APIConnectionError):
    """The request took longer than the client's timeout (or the server's deadline passed)."""
