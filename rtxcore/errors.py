"""Exceptions raised by rtx-serve. Each carries a message meant to be shown to a user as it is.

A request that fails says why with a :class:`RequestError`: a protocol-free :class:`ErrorCode`, the message, the
field at fault (``param``), how long to wait before retrying (``retry_after_s``) and a short machine-readable
``reason``. The HTTP and gRPC servers each map the code to their own status, in one place each.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Mapping
from typing import Any


class RtxError(Exception):
    """Base class of every error rtx-serve raises on purpose."""


class EngineFailed(RtxError):
    """The engine loop died (a backend step raised, a parallel rank is gone): no request's fault, and nothing in
    this process will step again. A server with a journal leaves its requests unfinished there, so the restart
    resumes them."""


class ErrorCode(enum.Enum):
    """What went wrong with a request, in words of no protocol (gRPC's status names, which fit any)."""

    INVALID_ARGUMENT = "invalid_argument"
    UNAUTHENTICATED = "unauthenticated"
    PERMISSION_DENIED = "permission_denied"
    NOT_FOUND = "not_found"
    # The request contradicts an earlier one (an idempotency key reused with another request).
    CONFLICT = "conflict"
    # The request cannot work on this server as configured (a resume without a request journal, say).
    FAILED_PRECONDITION = "failed_precondition"
    OUT_OF_RANGE = "out_of_range"
    RESOURCE_EXHAUSTED = "resource_exhausted"
    UNAVAILABLE = "unavailable"
    DEADLINE_EXCEEDED = "deadline_exceeded"
    # Its client cancelled it (DELETE /v1/streams/{id}, gRPC Cancel) before it could run again after a restart.
    CANCELLED = "cancelled"
    INTERNAL = "internal"


class RequestError(RtxError):
    """An error a request ends with, shown to its client as it is."""

    def __init__(self, code: ErrorCode, message: str, *, param: str | None = None,
                 retry_after_s: float | None = None, reason: str | None = None):
        """:param param: the request field at fault, if one is.
        :param retry_after_s: seconds to wait before trying again; None when retrying will not help.
        :param reason: a short label of the cause (``queue_full``, ``rate_limited``, ...), for clients and metrics.
        """
        super().__init__(message)
        self.code = code
        self.message = message
        self.param = param
        self.retry_after_s = retry_after_s
        self.reason = reason

    def rename_param(self, names: Mapping[str, str]) -> None:
        """Name the field at fault as the client sent it (``names``: the engine's name to the request's), in
        ``param`` and wherever the message names it (``"structured_output: ..."`` becomes ``"guided_regex: ..."``)."""
        new = names.get(self.param or "")
        if self.param is None or new is None:
            return
        self.message = re.sub(rf"\b{re.escape(self.param)}\b", new, self.message)
        self.args = (self.message,)
        self.param = new

    def to_json(self) -> dict[str, Any]:
        return {"code": self.code.value, "message": self.message, "param": self.param,
                "retry_after_s": self.retry_after_s, "reason": self.reason}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> RequestError:
        return cls(ErrorCode(data["code"]), str(data["message"]), param=data.get("param"),
                   retry_after_s=data.get("retry_after_s"), reason=data.get("reason"))


class InvalidRequestError(RequestError, ValueError):
    """A request's prompt or sampling parameters are not acceptable; ``param`` names the offending field."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(ErrorCode.INVALID_ARGUMENT, message, param=param, reason="invalid_value")


class CapacityError(InvalidRequestError):
    """A request can never fit: longer than the context or larger than the whole KV cache."""


class AdmissionRefused(RequestError):
    """A scheduler will not take a request now (its lane's queue is full, its predicted wait misses the lane's
    target, or brownout sheds its lane); the client should retry after ``retry_after_s``.

    ``reason`` is a short label for metrics and clients (``queue_full``, ``predicted_wait``, ``brownout``).
    """

    def __init__(self, message: str, retry_after_s: float, reason: str):
        super().__init__(ErrorCode.RESOURCE_EXHAUSTED, message, retry_after_s=retry_after_s, reason=reason)


class ModelLoadError(RtxError):
    """A model could not be found, read or understood."""


class PluginError(RtxError):
    """A plugin could not be loaded, registered or resolved."""


class ConfigError(RtxError, ValueError):
    """An engine, cache or scheduler setting is invalid."""
