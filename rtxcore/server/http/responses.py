"""Answering a generation over HTTP: admit it through the serving core, then stream its events as SSE or return
its final body; ``Last-Event-ID`` for a client that comes back.

With a state dir the request runs on when its client leaves (the client resumes with ``GET /v1/streams/{id}``);
without one, the connection's end cancels its producer, which aborts the engine requests.
"""

from __future__ import annotations

from typing import Any, AsyncGenerator, Awaitable, Callable

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from rtxcore.errors import ErrorCode, RequestError
from rtxcore.server.http import idempotency as http_idempotency
from rtxcore.server.http.common import ClientGone, read_json, tenant_name, until_disconnected
from rtxcore.server.http.errors import APIError, status_of
from rtxcore.server.http.sse import DONE, EventStreamResponse, sse_event
from rtxcore.server.serving import idempotency
from rtxcore.server.serving.lifecycle import Started, begin
from rtxcore.server.serving.limits import RETRY_AFTER_S
from rtxcore.server.serving.runtime import ServingRuntime
from rtxcore.server.serving.served_request import ServedRequest

# Names the request in every generation response: what GET /v1/streams/{request_id} takes.
RTX_REQUEST_ID_HEADER = "x-rtx-request-id"
LAST_EVENT_ID_HEADER = "last-event-id"

StartFn = Callable[[Request, dict[str, Any]], Awaitable[Started]]


async def serve_generation(runtime: ServingRuntime, request: Request, start: StartFn
                           ) -> Response | EventStreamResponse:
    """A POST generation route: a repeated ``Idempotency-Key`` attaches to its request; otherwise ``start`` parses
    and admits the body, and the response follows the new request."""
    runtime.engine()
    body = await read_json(request)
    key = http_idempotency.idempotency_key(request)
    tenant = tenant_name(request)
    existing, claim = await idempotency.claim(runtime, tenant, key, http_idempotency.fingerprint(request, body))
    if existing is not None:
        return await answer(request, existing, last_event_id(request, existing), detached=True)
    try:
        started = await start(request, body)
        entry = await begin(runtime, started, claim)
    except BaseException:
        idempotency.release(runtime, tenant, claim)
        raise
    return await answer(request, entry, 0, detached=runtime.durable is not None)


async def answer(request: Request, entry: ServedRequest, after_seq: int, detached: bool
                 ) -> Response | EventStreamResponse:
    """The response following ``entry`` from event ``after_seq`` on (an SSE stream), or its final body.

    :param detached: the request runs on when this client leaves (durable); otherwise leaving cancels it.
    """
    headers = {RTX_REQUEST_ID_HEADER: entry.req_id}

    def cancel() -> None:
        if not detached and entry.producer is not None:
            entry.producer.cancel()

    if entry.stream:
        return EventStreamResponse(sse_frames(entry, after_seq), on_close=cancel, headers=headers)
    try:
        await until_disconnected(request, entry.wait_finished())
    except ClientGone:
        cancel()
        raise
    if not entry.finished:  # abandoned: the engine failed, or the server is stopping; the journal keeps it
        raise RequestError(ErrorCode.UNAVAILABLE, f"the server stopped serving before request {entry.req_id} "
                           "finished; it is in the journal and resumes when the server is back: send it again with "
                           "the same Idempotency-Key to get its response", retry_after_s=RETRY_AFTER_S)
    status = status_of(entry.error) if entry.error is not None else 200
    return JSONResponse(entry.final_body, status_code=status, headers=headers)


async def sse_frames(entry: ServedRequest, after_seq: int) -> AsyncGenerator[bytes, None]:
    async for seq, payload in entry.follow(after_seq):
        yield sse_event(seq, payload)
    if entry.ends_with_done and entry.finished:  # an abandoned stream (shutdown) ends without [DONE]
        # [DONE] has an id too, one past the last event, so every event a client sees can be resumed after.
        yield b"id: %d\n" % (entry.last_seq + 1) + DONE


def last_event_id(request: Request, entry: ServedRequest) -> int:
    """The last event the client saw: 0 for none; 400 unless it is an event this stream has sent (or its
    ``[DONE]``, one past the last event of a finished stream)."""
    header = request.headers.get(LAST_EVENT_ID_HEADER)
    query = request.query_params.get("last_event_id")
    if header is not None and query is not None and header.strip() != query.strip():
        raise APIError(400, f"Last-Event-ID {header!r} contradicts last_event_id={query!r}", param="last_event_id")
    value = header if header is not None else query
    if value is None or value.strip() == "":
        return 0
    try:
        seq = int(value.strip())
    except ValueError:
        raise APIError(400, f"last_event_id must be an event id (a non-negative integer), got {value!r}",
                       param="last_event_id") from None
    done_id = entry.last_seq + 1 if entry.finished and entry.ends_with_done else entry.last_seq
    if seq < 0 or seq > done_id:
        raise APIError(400, f"last_event_id {seq} is not an event of this stream (its last event so far is "
                            f"{entry.last_seq})", param="last_event_id")
    return seq
