"""Clients of the ``rtx.v1.Rtx`` gRPC service, sync and async.

``generate`` returns a generator of ``GenerateResponse`` messages; closing it early (or cancelling the task that
iterates the async one) cancels the call, and the server aborts the request (unless it journals requests, see
below). Calls are retried by :class:`RetryPolicy` on RESOURCE_EXHAUSTED / UNAVAILABLE, honouring the server's
``retry-after`` metadata.

A stream is retried only before its first message, unless the server journals requests (``rtx serve
--state-dir``): then every message carries the request's id and an event id, and a stream cut by a retryable error
after it started, as when the server restarts, goes on with ``Resume`` after the last message received. Nothing is
delivered twice or skipped. ``resume`` follows a journaled request from any event, for a client that lost its
iterator.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any, AsyncIterator, Iterator, Sequence

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from rtxcore.client.errors import APIError, APITimeoutError
from rtxcore.client.retry import RetryPolicy, parse_retry_after
from rtxcore.server.grpc.codegen import ensure_generated

ensure_generated()
from rtxcore._generated import rtx_pb2, rtx_pb2_grpc  # noqa: E402

DEFAULT_TARGET = "127.0.0.1:50051"
# Each call's deadline, streams included: as long as the server's own default request timeout.
DEFAULT_TIMEOUT_S = 600.0
HEALTH_TIMEOUT_S = 10.0
Prompt = str | Sequence[int]


class GrpcClient:
    """Sync client. ``timeout`` is each call's deadline in seconds, streams included (None: no deadline); a call
    may pass its own."""

    def __init__(self, target: str = DEFAULT_TARGET, *, timeout: float | None = DEFAULT_TIMEOUT_S,
                 retry: RetryPolicy | None = None, channel: grpc.Channel | None = None):
        self.timeout = timeout
        self.retry = retry or RetryPolicy()
        self._owns_channel = channel is None
        self.channel = channel or grpc.insecure_channel(target)
        self._stub = rtx_pb2_grpc.RtxStub(self.channel)
        self._health = health_pb2_grpc.HealthStub(self.channel)

    def __enter__(self) -> GrpcClient:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def close(self) -> None:
        if self._owns_channel:
            self.channel.close()

    def generate(self, prompt: Prompt, *, timeout: float | None = None, resume: bool = True, **fields: Any
                 ) -> Iterator[rtx_pb2.GenerateResponse]:
        """Stream a request; ``fields`` are ``GenerateRequest`` fields (``max_tokens``, ``temperature``, ``model``,
        ``stop``...). ``resume``: go on with ``Resume`` when a journaled stream is cut (see the module docstring)."""
        request = generate_request(prompt, **fields)
        yield from self._stream(lambda: self._stub.Generate(request, timeout=timeout or self.timeout), timeout,
                                resume)

    def resume(self, request_id: str, after_event_id: int = 0, *, timeout: float | None = None
               ) -> Iterator[rtx_pb2.GenerateResponse]:
        """The messages of journaled request ``request_id`` after event ``after_event_id`` (0: all of them), replayed
        then live, until it finishes; also after a restart of the server."""
        request = rtx_pb2.ResumeRequest(request_id=request_id, after_event_id=after_event_id)
        yield from self._stream(lambda: self._stub.Resume(request, timeout=timeout or self.timeout), timeout,
                                resume=True)

    def _stream(self, open_call, timeout: float | None, resume: bool) -> Iterator[rtx_pb2.GenerateResponse]:
        attempt, last = 1, None
        while True:
            # After a message, only the journal can go on without a repeat or a gap.
            call = open_call() if last is None else self._stub.Resume(resume_request(last),
                                                                      timeout=timeout or self.timeout)
            try:
                for response in call:
                    attempt, last = 1, response
                    yield response
                return
            except grpc.RpcError as exc:
                error = error_from_rpc(exc)
                if (delay := retry_delay(self.retry, attempt, error, last, resume)) is None:
                    raise error from None
            finally:
                call.cancel()  # no-op once the call has ended; aborts the request when the caller left early
            time.sleep(delay)
            attempt += 1

    def embed(self, inputs: Sequence[Prompt], *, model: str = "", timeout: float | None = None
              ) -> rtx_pb2.EmbedResponse:
        request = embed_request(inputs, model)
        attempt = 1
        while True:
            try:
                return self._stub.Embed(request, timeout=timeout or self.timeout)
            except grpc.RpcError as exc:
                error = error_from_rpc(exc)
                if (delay := self.retry.delay(attempt, error)) is None:
                    raise error from None
            time.sleep(delay)
            attempt += 1

    def health(self, service: str = "", *, timeout: float | None = None) -> str:
        """The health status name (``SERVING``, ``NOT_SERVING``...) of ``service`` ("" is the whole server)."""
        try:
            response = self._health.Check(health_pb2.HealthCheckRequest(service=service),
                                          timeout=timeout or HEALTH_TIMEOUT_S)
        except grpc.RpcError as exc:
            raise error_from_rpc(exc) from None
        return health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)


class AsyncGrpcClient:
    """Async client with the same methods as :class:`GrpcClient`; its channel is opened on first use, in the
    running event loop."""

    def __init__(self, target: str = DEFAULT_TARGET, *, timeout: float | None = DEFAULT_TIMEOUT_S,
                 retry: RetryPolicy | None = None):
        self.target = target
        self.timeout = timeout
        self.retry = retry or RetryPolicy()
        self._channel: grpc.aio.Channel | None = None

    async def __aenter__(self) -> AsyncGrpcClient:
        return self

    async def __aexit__(self, *exc_info) -> None:
        await self.close()

    async def close(self) -> None:
        if self._channel is not None:
            await self._channel.close()
            self._channel = None

    @property
    def channel(self) -> grpc.aio.Channel:
        if self._channel is None:
            self._channel = grpc.aio.insecure_channel(self.target)
        return self._channel

    async def generate(self, prompt: Prompt, *, timeout: float | None = None, resume: bool = True, **fields: Any
                       ) -> AsyncIterator[rtx_pb2.GenerateResponse]:
        request = generate_request(prompt, **fields)
        stub = rtx_pb2_grpc.RtxStub(self.channel)
        async for response in self._stream(stub, lambda: stub.Generate(request, timeout=timeout or self.timeout),
                                           timeout, resume):
            yield response

    async def resume(self, request_id: str, after_event_id: int = 0, *, timeout: float | None = None
                     ) -> AsyncIterator[rtx_pb2.GenerateResponse]:
        request = rtx_pb2.ResumeRequest(request_id=request_id, after_event_id=after_event_id)
        stub = rtx_pb2_grpc.RtxStub(self.channel)
        async for response in self._stream(stub, lambda: stub.Resume(request, timeout=timeout or self.timeout),
                                           timeout, resume=True):
            yield response

    async def _stream(self, stub, open_call, timeout: float | None, resume: bool
                      ) -> AsyncIterator[rtx_pb2.GenerateResponse]:
        attempt, last = 1, None
        while True:
            call = open_call() if last is None else stub.Resume(resume_request(last), timeout=timeout or self.timeout)
            try:
                async for response in call:
                    attempt, last = 1, response
                    yield response
                return
            except grpc.RpcError as exc:
                error = error_from_rpc(exc)
                if (delay := retry_delay(self.retry, attempt, error, last, resume)) is None:
                    raise error from None
            finally:
                call.cancel()
            await asyncio.sleep(delay)
            attempt += 1

    async def embed(self, inputs: Sequence[Prompt], *, model: str = "", timeout: float | None = None
                    ) -> rtx_pb2.EmbedResponse:
        request = embed_request(inputs, model)
        stub = rtx_pb2_grpc.RtxStub(self.channel)
        attempt = 1
        while True:
            try:
                return await stub.Embed(request, timeout=timeout or self.timeout)
            except grpc.RpcError as exc:
                error = error_from_rpc(exc)
                if (delay := self.retry.delay(attempt, error)) is None:
                    raise error from None
            await asyncio.sleep(delay)
            attempt += 1

    async def health(self, service: str = "", *, timeout: float | None = None) -> str:
        stub = health_pb2_grpc.HealthStub(self.channel)
        try:
            response = await stub.Check(health_pb2.HealthCheckRequest(service=service),
                                        timeout=timeout or HEALTH_TIMEOUT_S)
        except grpc.RpcError as exc:
            raise error_from_rpc(exc) from None
        return health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)


def retry_delay(policy: RetryPolicy, attempt: int, error: APIError, last: rtx_pb2.GenerateResponse | None,
                resume: bool) -> float | None:
    """Seconds to wait before going on with a stream that ``error`` ended, or None to raise it. After a message
    (``last``) the stream can go on only from the journal: with ``resume`` and an event id to resume after."""
    if last is not None and not (resume and last.event_id > 0 and last.request_id):
        return None
    return policy.delay(attempt, error)


def resume_request(last: rtx_pb2.GenerateResponse) -> rtx_pb2.ResumeRequest:
    """The ``Resume`` call that goes on after message ``last``."""
    return rtx_pb2.ResumeRequest(request_id=last.request_id, after_event_id=last.event_id)


def generate_request(prompt: Prompt, **fields: Any) -> rtx_pb2.GenerateRequest:
    """A ``GenerateRequest`` from a text or token-id prompt; fields set to None are left unset."""
    fields = {k: v for k, v in fields.items() if v is not None}
    if isinstance(prompt, str):
        return rtx_pb2.GenerateRequest(text=prompt, **fields)
    return rtx_pb2.GenerateRequest(token_ids=rtx_pb2.TokenIds(ids=list(prompt)), **fields)


def embed_request(inputs: Sequence[Prompt], model: str = "") -> rtx_pb2.EmbedRequest:
    if isinstance(inputs, str):
        inputs = [inputs]
    texts = [x for x in inputs if isinstance(x, str)]
    token_lists = [rtx_pb2.TokenIds(ids=list(x)) for x in inputs if not isinstance(x, str)]
    if texts and token_lists:
        raise ValueError("embed inputs must be all text or all token-id lists, not a mix")
    return rtx_pb2.EmbedRequest(inputs=texts, token_inputs=token_lists, model=model)


def error_from_rpc(exc: grpc.RpcError) -> APIError:
    """An :class:`APIError` carrying the status name, message, offending field and ``retry-after`` of a failed
    call."""
    code = exc.code() if hasattr(exc, "code") else grpc.StatusCode.UNKNOWN
    trailers = dict(exc.trailing_metadata() or ()) if hasattr(exc, "trailing_metadata") else {}
    message = (exc.details() if hasattr(exc, "details") else None) or str(exc)
    error_type = APITimeoutError if code == grpc.StatusCode.DEADLINE_EXCEEDED else APIError
    return error_type(message, code=code.name, param=trailers.get("rtx-param"),
                      retry_after=parse_retry_after(trailers.get("retry-after")))
