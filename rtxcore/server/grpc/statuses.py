"""Errors as gRPC statuses: each :class:`RequestError` code maps to its status here, in one table, with
``retry-after`` (whole seconds) and ``rtx-param`` (the field at fault) in the trailing metadata."""

from __future__ import annotations

import contextlib
import math
from collections.abc import AsyncIterator
from typing import NoReturn

import grpc

from rtxcore.errors import ErrorCode, RequestError

STATUS = {
    ErrorCode.INVALID_ARGUMENT: grpc.StatusCode.INVALID_ARGUMENT,
    ErrorCode.UNAUTHENTICATED: grpc.StatusCode.UNAUTHENTICATED,
    ErrorCode.PERMISSION_DENIED: grpc.StatusCode.PERMISSION_DENIED,
    ErrorCode.NOT_FOUND: grpc.StatusCode.NOT_FOUND,
    ErrorCode.CONFLICT: grpc.StatusCode.ALREADY_EXISTS,
    ErrorCode.FAILED_PRECONDITION: grpc.StatusCode.FAILED_PRECONDITION,
    ErrorCode.OUT_OF_RANGE: grpc.StatusCode.OUT_OF_RANGE,
    ErrorCode.RESOURCE_EXHAUSTED: grpc.StatusCode.RESOURCE_EXHAUSTED,
    ErrorCode.UNAVAILABLE: grpc.StatusCode.UNAVAILABLE,
    ErrorCode.DEADLINE_EXCEEDED: grpc.StatusCode.DEADLINE_EXCEEDED,
    ErrorCode.CANCELLED: grpc.StatusCode.CANCELLED,
    ErrorCode.INTERNAL: grpc.StatusCode.INTERNAL,
}


async def abort_with(context: grpc.aio.ServicerContext, err: RequestError) -> NoReturn:
    """End the call with ``err``'s status (``context.abort`` raises)."""
    metadata = []
    if err.retry_after_s is not None:
        metadata.append(("retry-after", str(max(1, math.ceil(err.retry_after_s)))))
    if err.param:
        metadata.append(("rtx-param", err.param))
    await context.abort(STATUS[err.code], err.message, trailing_metadata=tuple(metadata))
    raise AssertionError("context.abort returned")  # it always raises; this tells the type checker so


@contextlib.asynccontextmanager
async def statuses_for(context: grpc.aio.ServicerContext) -> AsyncIterator[None]:
    """Run the body, ending the call with the status of any :class:`RequestError` it raises."""
    try:
        yield
    except RequestError as exc:
        await abort_with(context, exc)
