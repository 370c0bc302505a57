"""Clients of the ``rtx.v1.Rtx`` gRPC service, sync and async.

``generate`` returns a generator of ``GenerateResponse`` messages; closing it early (or cancelling the task that
iterates the async one) cancels the call, and the server aborts the request (unless it journals requests, see
below). Calls are retried by :class:`RetryPolicy` on RESOURCE_EXHAUSTED / UNAVAILABLE, honouring the server's
``retry-after`` metadata.

A stream is retried only before its first message, unless the server journals requests (``rtx serve
--state-dir``). Then the call's initial metadata and every message carry the request's journal id, and messages an
event id, and a stream cut by a retryable error, as when the server restarts, goes on with ``Resume`` after the last
message received (or from the start, if none came yet) for up to ``RetryPolicy.max_resume_wait_s``: nothing is
delivered twice or skipped, and a request the server has named is not sent again. ``resume`` follows a journaled
request from any event, for a client that lost its iterator.

``timeout`` is each call's gRPC deadline: for a stream, from its start to its last message (a stream that resumes
is several calls, each with its own). ``None`` sets none.

What HTTP carries in headers goes in call metadata: the client's ``api_key`` (``authorization: Bearer``), a
``lane`` (``x-rtx-lane``), and any other pairs passed as ``metadata`` (``traceparent``, ``x-rtx-cache-salt``...), on
the client for every call and per call.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any, AsyncIterator, Iterator, Sequence

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from rtxcore.client.errors import APIError, APITimeoutError
from rtxcore.client.retry import RetryPolicy, is_retryable, parse_retry_after
from rtxcore.server.grpc.codegen import ensure_generated

ensure_generated()
from rtxcore._generated import rtx_pb2, rtx_pb2_grpc  # noqa: E402

DEFAULT_TARGET = "127.0.0.1:50051"
# Each call's deadline, streams included: as long as the server's own default request timeout.
DEFAULT_TIMEOUT_S = 600.0
HEALTH_TIMEOUT_S = 10.0
# The server's initial metadata naming a journaled request (rtxcore.server.grpc.servicer.RTX_REQUEST_ID_METADATA).
RTX_REQUEST_ID_METADATA = "x-rtx-request-id"
# The request's SLA lane (rtxcore.server.grpc.servicer.LANE_METADATA).
LANE_METADATA = "x-rtx-lane"
# gRPC waits up to two minutes between reconnection attempts by default; a stream waiting to resume would notice a
# restarted server that late.
CHANNEL_OPTIONS = [("grpc.max_reconnect_backoff_ms", 2000)]
Prompt = str | Sequence[int]
Metadata = Sequence[tuple[str, str]]


def call_metadata(base: Metadata, lane: str | None, extra: Metadata | None) -> tuple[tuple[str, str], ...]:
    """The metadata of one call: the client's, then the call's lane and pairs (a key given twice is sent twice;
    the server reads the last)."""
    pairs = [*base, *([(LANE_METADATA, lane)] if lane is not None else []), *(extra or ())]
    for key, value in pairs:
        if not isinstance(key, str) or not isinstance(value, str) or key != key.lower():
            raise ValueError(f"gRPC metadata must be (lowercase key, str value) pairs, got {(key, value)!r}")
    return tuple(pairs)


def client_metadata(api_key: str | None, lane: str | None, metadata: Metadata | None) -> tuple[tuple[str, str], ...]:
    auth = (("authorization", f"Bearer {api_key}"),) if api_key else ()
    return call_metadata(auth, lane, metadata)


def open_channel(target: str, credentials: grpc.ChannelCredentials | None) -> grpc.Channel:
    if credentials is None:
        return grpc.insecure_channel(target, options=CHANNEL_OPTIONS)
    return grpc.secure_channel(target, credentials, options=CHANNEL_OPTIONS)


class GrpcClient:
    """Sync client. ``timeout`` is each call's deadline in seconds, a stream's whole length included (None: no
    deadline); a call may pass its own. ``api_key``, ``lane`` and ``metadata`` go with every call (see the module
    docstring); ``credentials`` (``grpc.ssl_channel_credentials(...)``) connect over TLS."""

    def __init__(self, target: str = DEFAULT_TARGET, *, api_key: str | None = None, lane: str | None = None,
                 metadata: Metadata | None = None, timeout: float | None = DEFAULT_TIMEOUT_S,
                 retry: RetryPolicy | None = None, credentials: grpc.ChannelCredentials | None = None,
                 channel: grpc.Channel | None = None):
        self.timeout = timeout
        self.retry = retry or RetryPolicy()
        self.metadata = client_metadata(api_key, lane, metadata)
        self._owns_channel = channel is None
        self.channel = channel or open_channel(target, credentials)
        self._stub = rtx_pb2_grpc.RtxStub(self.channel)
        self._health = health_pb2_grpc.HealthStub(self.channel)

    def __enter__(self) -> GrpcClient:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def close(self) -> None:
        if self._owns_channel:
            self.channel.close()

    def generate(self, prompt: Prompt, *, timeout: float | None = None, resume: bool = True,
                 lane: str | None = None, metadata: Metadata | None = None, **fields: Any
                 ) -> Iterator[rtx_pb2.GenerateResponse]:
        """Stream a request; ``fields`` are ``GenerateRequest`` fields (``max_tokens``, ``temperature``, ``model``,
        ``stop``...), ``lane`` and ``metadata`` this call's own. ``resume``: go on with ``Resume`` when a journaled
        stream is cut (see the module docstring)."""
        request = generate_request(prompt, **fields)
        return self._stream(request, StreamProgress(self.retry, resume), timeout,
                            call_metadata(self.metadata, lane, metadata))

    def resume(self, request_id: str, after_event_id: int = 0, *, timeout: float | None = None,
               metadata: Metadata | None = None) -> Iterator[rtx_pb2.GenerateResponse]:
        """The messages of journaled request ``request_id`` after event ``after_event_id`` (0: all of them), replayed
        then live, until it finishes; also across a restart of the server."""
        return self._stream(None, StreamProgress(self.retry, True, request_id, after_event_id), timeout,
                            call_metadata(self.metadata, None, metadata))

    def _stream(self, request: rtx_pb2.GenerateRequest | None, progress: StreamProgress, timeout: float | None,
                metadata: Metadata) -> Iterator[rtx_pb2.GenerateResponse]:
        while True:
            resume = progress.resume_request()
            call = (self._stub.Resume(resume, timeout=timeout or self.timeout, metadata=metadata)
                    if resume is not None else
                    self._stub.Generate(request, timeout=timeout or self.timeout, metadata=metadata))
            try:
                for response in call:
                    progress.received(response)
                    yield response
                return
            except grpc.RpcError as exc:
                progress.saw_metadata(call.initial_metadata())
                if progress.finished:  # cut after the last message: nothing is missing
                    return
                delay = progress.delay_after(error_from_rpc(exc))
            finally:
                call.cancel()  # no-op once the call has ended; aborts the request when the caller left early
            time.sleep(delay)

    def cancel(self, request_id: str, *, timeout: float | None = None, metadata: Metadata | None = None) -> bool:
        """Stop journaled request ``request_id`` (closing its iterator does not, with a journal): its streams end
        with finish_reason "abort". Returns whether it was still running."""
        try:
            response = self._stub.Cancel(rtx_pb2.CancelRequest(request_id=request_id),
                                         timeout=timeout or self.timeout,
                                         metadata=call_metadata(self.metadata, None, metadata))
        except grpc.RpcError as exc:
            raise error_from_rpc(exc) from None
        return bool(response.cancelled)

    def embed(self, inputs: Sequence[Prompt], *, model: str = "", timeout: float | None = None,
              metadata: Metadata | None = None) -> rtx_pb2.EmbedResponse:
        request = embed_request(inputs, model)
        pairs = call_metadata(self.metadata, None, metadata)
        attempt = 1
        while True:
            try:
                return self._stub.Embed(request, timeout=timeout or self.timeout, metadata=pairs)
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

    def __init__(self, target: str = DEFAULT_TARGET, *, api_key: str | None = None, lane: str | None = None,
                 metadata: Metadata | None = None, timeout: float | None = DEFAULT_TIMEOUT_S,
                 retry: RetryPolicy | None = None, credentials: grpc.ChannelCredentials | None = None):
        self.target = target
        self.timeout = timeout
        self.retry = retry or RetryPolicy()
        self.metadata = client_metadata(api_key, lane, metadata)
        self._credentials = credentials
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
            self._channel = (grpc.aio.insecure_channel(self.target, options=CHANNEL_OPTIONS)
                             if self._credentials is None else
                             grpc.aio.secure_channel(self.target, self._credentials, options=CHANNEL_OPTIONS))
        return self._channel

    def generate(self, prompt: Prompt, *, timeout: float | None = None, resume: bool = True,
                 lane: str | None = None, metadata: Metadata | None = None, **fields: Any
                 ) -> AsyncIterator[rtx_pb2.GenerateResponse]:
        request = generate_request(prompt, **fields)
        return self._stream(request, StreamProgress(self.retry, resume), timeout,
                            call_metadata(self.metadata, lane, metadata))

    def resume(self, request_id: str, after_event_id: int = 0, *, timeout: float | None = None,
               metadata: Metadata | None = None) -> AsyncIterator[rtx_pb2.GenerateResponse]:
        return self._stream(None, StreamProgress(self.retry, True, request_id, after_event_id), timeout,
                            call_metadata(self.metadata, None, metadata))

    async def _stream(self, request: rtx_pb2.GenerateRequest | None, progress: StreamProgress,
                      timeout: float | None, metadata: Metadata) -> AsyncIterator[rtx_pb2.GenerateResponse]:
        stub = rtx_pb2_grpc.RtxStub(self.channel)
        while True:
            resume = progress.resume_request()
            call = (stub.Resume(resume, timeout=timeout or self.timeout, metadata=metadata)
                    if resume is not None else
                    stub.Generate(request, timeout=timeout or self.timeout, metadata=metadata))
            try:
                async for response in call:
                    progress.received(response)
                    yield response
                return
            except grpc.RpcError as exc:
                progress.saw_metadata(await call.initial_metadata())
                if progress.finished:
                    return
                delay = progress.delay_after(error_from_rpc(exc))
            finally:
                call.cancel()
            await asyncio.sleep(delay)

    async def cancel(self, request_id: str, *, timeout: float | None = None,
                     metadata: Metadata | None = None) -> bool:
        stub = rtx_pb2_grpc.RtxStub(self.channel)
        try:
            response = await stub.Cancel(rtx_pb2.CancelRequest(request_id=request_id),
                                         timeout=timeout or self.timeout,
                                         metadata=call_metadata(self.metadata, None, metadata))
        except grpc.RpcError as exc:
            raise error_from_rpc(exc) from None
        return bool(response.cancelled)

    async def embed(self, inputs: Sequence[Prompt], *, model: str = "", timeout: float | None = None,
                    metadata: Metadata | None = None) -> rtx_pb2.EmbedResponse:
        request = embed_request(inputs, model)
        pairs = call_metadata(self.metadata, None, metadata)
        stub = rtx_pb2_grpc.RtxStub(self.channel)
        attempt = 1
        while True:
            try:
                return await stub.Embed(request, timeout=timeout or self.timeout, metadata=pairs)
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


class StreamProgress:
    """How far a ``Generate`` (or ``Resume``) stream got, and so how to go on after a failed call: send the request
    again (nothing reached the caller and the server did not journal it), ``Resume`` it from the journal, or give
    up. Shared by the sync and async clients."""

    def __init__(self, policy: RetryPolicy, resume: bool, request_id: str = "", after_event_id: int = 0):
        self.policy = policy
        self.resume = resume
        self.request_id = request_id  # the journal's id, once known
        self.after_event_id = after_event_id
        self.delivered = False
        self.finished = False
        self._attempt = 1
        self._cut: tuple[float, APIError] | None = None  # when and how the stream was first cut since its last message

    def received(self, response: rtx_pb2.GenerateResponse) -> None:
        self.delivered, self.finished, self._attempt, self._cut = True, response.finished, 1, None
        if response.event_id > 0 and response.request_id:
            self.request_id, self.after_event_id = response.request_id, response.event_id

    def saw_metadata(self, metadata) -> None:
        """A journaled call names its request in its initial metadata, before any message."""
        if not self.request_id:
            self.request_id = dict(metadata or ()).get(RTX_REQUEST_ID_METADATA, "")

    def resume_request(self) -> rtx_pb2.ResumeRequest | None:
        """The ``Resume`` to call next, or None to send the request itself."""
        if self.resume and self.request_id:
            return rtx_pb2.ResumeRequest(request_id=self.request_id, after_event_id=self.after_event_id)
        return None

    def delay_after(self, error: APIError) -> float:
        """Seconds to wait before the next call after ``error``.

        :raises APIError: ``error`` (caused by the error that first cut a resumed stream) when it is not worth
            another call.
        """
        attempt, self._attempt = self._attempt, self._attempt + 1
        if self.resume_request() is not None and self.policy.max_attempts > 1:  # NO_RETRY: no further call
            now = time.monotonic()
            first_cut_at, cut = self._cut or (now, error)
            self._cut = (first_cut_at, cut)
            waited = now - first_cut_at
            if is_retryable(error) and waited < self.policy.max_resume_wait_s:
                backoff = min(self.policy.backoff_s * 2 ** (attempt - 1), self.policy.max_backoff_s)
                wait = error.retry_after if error.retry_after is not None else backoff
                return min(wait, self.policy.max_resume_wait_s - waited)
            raise error from (cut if cut is not error else None)
        if not self.delivered and (delay := self.policy.delay(attempt, error)) is not None:
            return delay
        raise error from None


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
