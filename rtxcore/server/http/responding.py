"""Answering a generation: journal it, produce its events in a task of its own, and stream or return them.

The producer task (:func:`produce`) turns the generation's outputs into events; each goes to the journal before it
is added to the request's event log, from which every response follows it (:func:`answer`). With a state dir the
producer outlives the connection: a client that drops resumes with ``GET /v1/streams/{id}``; without one, the
connection's end cancels the producer, which aborts the engine requests.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from dataclasses import dataclass
from typing import Any, AsyncIterator, Awaitable, Callable

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from rtxcore.engine.outputs import RequestOutput
from rtxcore.errors import InvalidRequestError, RtxError
from rtxcore.sampling_params import SamplingParams
from rtxcore.server.durable.entry import DurableRequest, IdempotencyClaim, new_request_id
from rtxcore.server.durable.journal import Journal, JournalClosed
from rtxcore.server.http import idempotency
from rtxcore.server.http.common import read_json, tenant_name
from rtxcore.server.http.errors import APIError
from rtxcore.server.http.formats import FORMATS, ResponseFormat, ResponseSpec, make_format
from rtxcore.server.http.generation import ClientGone, Generation, ensure_engine, until_disconnected
from rtxcore.server.http.sse import DONE, EventStreamResponse, sse_event, sse_json

log = logging.getLogger("rtx.server")
from rtxcore.server.runtime import ServingRuntime

# Names the request in every generation response: what GET /v1/streams/{request_id} takes.
RTX_REQUEST_ID_HEADER = "x-rtx-request-id"
LAST_EVENT_ID_HEADER = "last-event-id"


@dataclass(slots=True)
class Started:
    """A generation the engine accepted, with what the journal needs to run it again."""

    gen: Generation
    spec: ResponseSpec
    prompts: list[list[int]]
    params: SamplingParams


StartFn = Callable[[Request, dict[str, Any]], Awaitable[Started]]


async def serve_generation(runtime: ServingRuntime, request: Request, start: StartFn) -> Response:
    """A POST generation route: a repeated ``Idempotency-Key`` attaches to its request; otherwise ``start`` parses
    and admits the body, and the response follows the new request."""
    ensure_engine(runtime)
    body = await read_json(request)
    existing, claim = await idempotency.claim(runtime, request, body)
    if existing is not None:
        runtime.durable.stats.num_idempotent_replays += 1
        return await answer(request, existing, last_event_id(request, existing), detached=True)
    try:
        started = await start(request, body)
    except BaseException:
        if claim is not None:
            runtime.durable.release_key(tenant_name(request), claim.key)
        raise
    return await respond(runtime, request, started, claim)


async def respond(runtime: ServingRuntime, request: Request, started: Started,
                  claim: IdempotencyClaim | None) -> Response:
    entry = await begin(runtime, started, claim)
    return await answer(request, entry, 0, detached=runtime.durable is not None)


async def begin(runtime: ServingRuntime, started: Started, claim: IdempotencyClaim | None) -> DurableRequest:
    """Journal an accepted generation (with a state dir: fsynced before anything acknowledges it) and start the
    task producing its events; returns the request the responses follow. On the event loop that serves HTTP."""
    gen, spec = started.gen, started.spec
    durable = runtime.durable
    entry = DurableRequest(new_request_id(), gen.route.tenant_name, spec.stream, claim,
                           FORMATS[spec.kind].ends_with_done, kind=spec.kind)
    journal = durable.journal if durable is not None else None
    if journal is not None:
        try:
            journal.append(accept_record(entry, started))
            await journal.commit()  # fsync: the request is durable before anything acknowledges it
        except BaseException:
            gen.close()
            if claim is not None:
                durable.release_key(entry.tenant, claim.key)
            with contextlib.suppress(JournalClosed):
                # Never acknowledged (the client left, or the server is stopping): a restart must not resume it.
                journal.append({"t": "finish", "id": entry.req_id, "time": time.time(), "status": 499, "body": None,
                                "void": True})
            raise
        durable.add(entry)
    fmt = make_format(spec, runtime.async_engine.core.tokenizer)
    entry.producer = start_producer(produce(entry, gen, fmt, journal, opening=True), gen)
    return entry


def start_producer(producing: Awaitable[None], gen: Generation) -> asyncio.Task:
    task = asyncio.ensure_future(producing)
    # A task cancelled before its first step never runs its body (nor its finally): close here as well, so that the
    # engine requests are aborted and the admission slots given back however it ends.
    task.add_done_callback(lambda _: gen.close())
    return task


async def answer(request: Request, entry: DurableRequest, after_seq: int, detached: bool) -> Response:
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
    return JSONResponse(entry.final_body, status_code=entry.final_status, headers=headers)


async def sse_frames(entry: DurableRequest, after_seq: int) -> AsyncIterator[bytes]:
    async for seq, payload in entry.follow(after_seq):
        yield sse_event(seq, payload)
    if entry.ends_with_done and entry.finished:  # an abandoned stream (shutdown) ends without [DONE]
        # [DONE] has an id too, one past the last event, so every event a client sees can be resumed after.
        yield b"id: %d\n" % (entry.last_seq + 1) + DONE


async def produce(entry: DurableRequest, gen: Generation, fmt: ResponseFormat, journal: Journal | None,
                  opening: bool) -> None:
    """Run ``gen`` to its end, journaling each output and event before the event is published to ``entry``.

    Cancelled (shutdown, or the only client gone without a state dir), it writes no finish record: a journaled
    request is then resumed by the next start.
    """
    stream = fmt.spec.stream

    def emit(payload: dict[str, Any] | None, output: dict[str, Any] | None) -> None:
        text = sse_json(payload) if payload is not None else None
        if journal is not None:
            record: dict[str, Any] = {"t": "out", "id": entry.req_id}
            if text is not None:
                record.update(seq=entry.last_seq + 1, ev=text)
            if output is not None:
                record["o"] = output
            journal.append(record)  # before the client can see it: never ahead of the journal
        if text is not None:
            entry.add_event(text)

    status, body, closing = 200, None, []
    try:
        try:
            if opening and stream:
                for payload in fmt.opening():
                    emit(payload, None)
            async for choice, out in gen.outputs():
                emit(fmt.chunk(gen, choice, out) if stream else None,
                     output_record(choice.index, out) if journal is not None else None)
            if stream:
                closing = fmt.closing(gen)
            else:
                body = fmt.body(gen)
        except TimeoutError:
            error = gen.timeout_error()
        except InvalidRequestError as exc:
            error = APIError.invalid(exc)
        except RtxError as exc:  # the engine failed under this request
            error = APIError(500, str(exc))
        except JournalClosed:
            raise
        except Exception as exc:  # a bug, or the journal's disk failing: a 500 for this request, never a hang
            log.exception("request %s failed", entry.req_id)
            error = APIError(500, f"internal error ({type(exc).__name__})")
        else:
            error = None
        if error is not None and stream:
            closing = [error.body()]
        elif error is not None:
            status, body = error.status, error.body()
        texts = [sse_json(p) for p in closing]
        try:
            conclude(entry, journal, texts, status, body)
        except OSError:
            log.exception("request %s: could not journal its end; it ends for its clients all the same",
                          entry.req_id)
            conclude(entry, None, texts, status, body)
    except JournalClosed:
        return  # the server is stopping: the next start resumes the request from the journal
    finally:
        gen.close()


def conclude(entry: DurableRequest, journal: Journal | None, texts: list[str], status: int,
             body: dict[str, Any] | None) -> None:
    """End a request: its last events and its finish record go to the journal in one write (a crash leaves both or
    neither, so a resumed request never sends its closing events twice), then to its clients."""
    if journal is not None:
        events = [{"t": "out", "id": entry.req_id, "seq": entry.last_seq + 1 + i, "ev": text}
                  for i, text in enumerate(texts)]
        journal.append_many([*events, {"t": "finish", "id": entry.req_id, "time": time.time(), "status": status,
                                       "body": body}])
    for text in texts:
        entry.add_event(text)
    entry.finish(status, body)


def accept_record(entry: DurableRequest, started: Started) -> dict[str, Any]:
    gen = started.gen
    route = gen.route
    return {"t": "accept", "id": entry.req_id, "time": entry.accepted_at, "spec": started.spec.to_json(),
            "gen_id": gen.req_id, "prompts": started.prompts, "params": dataclasses.asdict(started.params),
            "lane": route.lane, "tenant": route.tenant_name, "cache_salt": route.cache_salt, "stream": entry.stream,
            "trace": dataclasses.asdict(gen.trace),
            "idempotency": dataclasses.asdict(entry.idempotency) if entry.idempotency is not None else None}


def output_record(index: int, out: RequestOutput) -> dict[str, Any]:
    record: dict[str, Any] = {"c": index, "tok": out.new_token_ids, "text": out.new_text,
                              "cached": out.num_cached_tokens}
    if out.logprobs is not None:
        record["lp"] = [[lp.token_id, lp.logprob, [[t, p] for t, p in lp.top]] for lp in out.logprobs]
    if out.finished:
        record.update(fin=out.finish_reason, stop=out.stop_reason)
    return record


def last_event_id(request: Request, entry: DurableRequest) -> int:
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
