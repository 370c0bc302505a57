"""A generation's life after admission, the same for every protocol: journal it, produce its events in a task of
its own, let any number of clients follow them, and end it.

:func:`begin` journals an accepted generation (with a state dir: fsynced before anything acknowledges it) and starts
its producer (:func:`produce`), which turns outputs into events; each event goes to the journal before it is added
to the request's event log, from which every client follows it (``ServedRequest.follow``). With a state dir the
producer outlives its client (who may resume); without one, the adapter cancels it when its client leaves, which
aborts the engine requests.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from dataclasses import dataclass
from typing import Any, Awaitable

from rtxcore.engine.outputs import RequestOutput
from rtxcore.errors import EngineFailed, ErrorCode, RequestError, RtxError
from rtxcore.sampling_params import SamplingParams
from rtxcore.server.serving.durable.journal import Journal, JournalClosed
from rtxcore.server.serving.formats import FORMATS, ResponseFormat, ResponseSpec, event_text, make_format
from rtxcore.server.serving.generation import Generation
from rtxcore.server.serving.limits import RETRY_AFTER_S
from rtxcore.server.serving.runtime import ServingRuntime
from rtxcore.server.serving.served_request import IdempotencyClaim, ServedRequest, new_request_id

log = logging.getLogger("rtx.server")


@dataclass(slots=True)
class Started:
    """A generation the engine accepted, with what the journal needs to run it again."""

    gen: Generation
    spec: ResponseSpec
    prompts: list[list[int]]
    params: SamplingParams
    # Choices per prompt (Generation's n).
    n: int = 1


async def begin(runtime: ServingRuntime, started: Started, claim: IdempotencyClaim | None = None) -> ServedRequest:
    """Journal an accepted generation and start the task producing its events; returns the request its clients
    follow.

    :raises RequestError: UNAVAILABLE when the server is stopping or the journal cannot be written (the generation
        is closed then, never acknowledged).
    """
    gen, spec = started.gen, started.spec
    durable = runtime.durable
    entry = ServedRequest(new_request_id(), gen.route.tenant_name, spec.stream, claim,
                          FORMATS[spec.kind].ends_with_done, kind=spec.kind)
    journal = durable.journal if durable is not None else None
    if durable is not None and journal is not None:
        try:
            journal.append_many([accept_record(entry, started)], must_write=True)
            await journal.commit()  # fsync: the request is durable before anything acknowledges it
        except BaseException as exc:
            gen.close()  # the caller frees the claimed key, if any
            with contextlib.suppress(JournalClosed, OSError):
                # Never acknowledged (the client left, or the server is stopping): a restart must not resume it.
                journal.append({"t": "finish", "id": entry.req_id, "time": time.time(), "error": None, "body": None,
                                "void": True})
            if isinstance(exc, JournalClosed):
                raise RequestError(ErrorCode.UNAVAILABLE, "the server is shutting down", retry_after_s=RETRY_AFTER_S,
                                   reason="not_ready") from None
            if isinstance(exc, OSError):
                # Never acknowledged, so nothing is lost: the client tries again once the disk takes writes.
                raise RequestError(ErrorCode.UNAVAILABLE, "the request journal cannot be written "
                                   f"({exc.strerror or exc}): try again later", retry_after_s=RETRY_AFTER_S,
                                   reason="journal_unavailable") from None
            raise
        durable.add(entry)
    fmt = make_format(spec, gen.tokenizer)
    entry.generation = gen
    entry.producer = start_producer(produce(entry, gen, fmt, journal, opening=True), gen)
    return entry


async def cancel(runtime: ServingRuntime, entry: ServedRequest) -> bool:
    """Stop a journaled request its client no longer wants (with a journal, leaving a stream does not): each choice
    still running finishes with finish_reason "abort", and the request ends as any finished one does, journaled,
    its streams closing with that last event. Returns whether it was still running.

    A cancel record is fsynced first, so a crash before the request's end is journaled does not run it again;
    a request still waiting to be resumed after a restart ends with a ``cancelled`` error instead.
    """
    if entry.finished:
        return False
    if not entry.cancel_requested and runtime.durable is not None:
        runtime.durable.journal.append({"t": "cancel", "id": entry.req_id, "time": time.time()})
        await runtime.durable.journal.commit()
    entry.cancel_requested = True
    if entry.generation is None:  # resuming after a restart, not running yet: _resume ends it
        return True
    return bool(await entry.generation.cancel())


def cancelled_error() -> RequestError:
    return RequestError(ErrorCode.CANCELLED, "cancelled by its client before it ran again after a restart",
                        reason="cancelled")


def start_producer(producing: Awaitable[None], gen: Generation) -> asyncio.Task:
    task = asyncio.ensure_future(producing)
    # A task cancelled before its first step never runs its body (nor its finally): close here as well, so that the
    # engine requests are aborted and the admission slots given back however it ends.
    task.add_done_callback(lambda _: gen.close())
    return task


async def produce(entry: ServedRequest, gen: Generation, fmt: ResponseFormat, journal: Journal | None,
                  opening: bool) -> None:
    """Run ``gen`` to its end, journaling each output and event before the event is published to ``entry``.

    Cancelled (shutdown, or the only client gone without a state dir), it writes no finish record: a journaled
    request is then resumed by the next start.
    """
    stream = fmt.spec.stream

    def emit(payload: dict[str, Any] | None, output: dict[str, Any] | None) -> None:
        if payload is not None and fmt.numbered_events:
            payload = {**payload, "sequence_number": entry.last_seq}
        text = event_text(payload) if payload is not None else None
        if journal is not None:
            record: dict[str, Any] = {"t": "out", "id": entry.req_id}
            if text is not None:
                record.update(seq=entry.last_seq + 1, ev=text)
            if output is not None:
                record["o"] = output
            journal.append(record)  # before the client can see it: never ahead of the journal
        if text is not None:
            entry.add_event(text)

    body: dict[str, Any] | None = None
    closing: list[dict[str, Any]] = []
    error: RequestError | None = None
    try:
        try:
            if opening and stream:
                for payload in fmt.opening():
                    emit(payload, None)
            async for choice, out in gen.outputs():
                record = output_record(choice.index, out) if journal is not None else None
                events: list[dict[str, Any] | None] = [*fmt.events(gen, choice, out)] if stream else []
                for event in events or [None]:  # the output's record goes with its first event, or alone
                    emit(event, record)
                    record = None
            if stream:
                closing = fmt.closing(gen)
            else:
                body = fmt.body(gen)
        except TimeoutError:
            error = gen.timeout_error()
        except RequestError as exc:
            exc.rename_param(fmt.spec.param_names)
            error = exc
        except EngineFailed as exc:
            if journal is not None:
                # Not this request's fault: leave it unfinished in the journal, as a crash would, and let its
                # clients go (a stream ends without [DONE]); the restart resumes it.
                log.error("request %s: %s; left in the journal for the restart", entry.req_id, exc)
                entry.abandon()
                return
            error = RequestError(ErrorCode.INTERNAL, str(exc))
        except RtxError as exc:  # the engine refused or failed under this request
            error = RequestError(ErrorCode.INTERNAL, str(exc))
        except JournalClosed:
            raise
        except Exception as exc:  # a bug, or the journal's disk failing: an error for this request, never a hang
            log.exception("request %s failed", entry.req_id)
            error = RequestError(ErrorCode.INTERNAL, f"internal error ({type(exc).__name__})")
        if error is not None and stream:
            closing = [fmt.error_event(error)]
        elif error is not None:
            body = fmt.error_body(error)
        if fmt.numbered_events:
            closing = [{**p, "sequence_number": entry.last_seq + i} for i, p in enumerate(closing)]
        texts = [event_text(p) for p in closing]
        try:
            conclude(entry, journal, texts, error, body)
        except OSError:
            log.exception("request %s: could not journal its end; it ends for its clients all the same",
                          entry.req_id)
            conclude(entry, None, texts, error, body)
    except JournalClosed:
        return  # the server is stopping: the next start resumes the request from the journal
    finally:
        gen.close()


def conclude(entry: ServedRequest, journal: Journal | None, texts: list[str], error: RequestError | None,
             body: dict[str, Any] | None) -> None:
    """End a request: its last events and its finish record go to the journal in one write (a crash leaves both or
    neither, so a resumed request never sends its closing events twice), then to its clients.

    :param error: what it failed with (None: it succeeded); a stream's error is also in its last event.
    :param body: the response of a non-streaming request.
    """
    if journal is not None:
        events = [{"t": "out", "id": entry.req_id, "seq": entry.last_seq + 1 + i, "ev": text}
                  for i, text in enumerate(texts)]
        journal.append_many([*events, {"t": "finish", "id": entry.req_id, "time": time.time(),
                                       "error": error.to_json() if error is not None else None, "body": body}])
    for text in texts:
        entry.add_event(text)
    entry.generation = None  # what it held (every choice's text) is in its events and body now
    entry.finish(error, body)


def accept_record(entry: ServedRequest, started: Started) -> dict[str, Any]:
    gen = started.gen
    route = gen.route
    return {"t": "accept", "id": entry.req_id, "time": entry.accepted_at, "spec": started.spec.to_json(),
            "gen_id": gen.req_id, "prompts": started.prompts, "params": dataclasses.asdict(started.params),
            "n": started.n,
            "lane": route.lane, "tenant": route.tenant_name, "cache_salt": route.cache_salt, "stream": entry.stream,
            "trace": dataclasses.asdict(gen.trace), **gen.speculation.to_json(),
            "idempotency": dataclasses.asdict(entry.idempotency) if entry.idempotency is not None else None}


def output_record(index: int, out: RequestOutput) -> dict[str, Any]:
    record: dict[str, Any] = {"c": index, "tok": out.new_token_ids, "text": out.new_text,
                              "cached": out.num_cached_tokens}
    if out.logprobs is not None:
        record["lp"] = [[lp.token_id, lp.logprob, [[t, p] for t, p in lp.top]] for lp in out.logprobs]
    if out.finished:
        record.update(fin=out.finish_reason, stop=out.stop_reason)
    return record


def find(runtime: ServingRuntime, req_id: str, tenant: str | None) -> ServedRequest:
    """The resumable request ``tenant`` made; another tenant's is as missing as an unknown one.

    :raises RequestError: FAILED_PRECONDITION without a request journal, NOT_FOUND when there is no such request.
    """
    durable = runtime.durable
    if durable is None:
        raise RequestError(ErrorCode.FAILED_PRECONDITION, "resumable requests need a server started with "
                           "`rtx serve --state-dir` (a request journal)", param="request_id")
    entry = durable.get(req_id, tenant)
    if entry is None:
        raise RequestError(ErrorCode.NOT_FOUND, f"no request {req_id!r}: unknown, or finished longer ago than the "
                           f"retention window ({durable.options.retention_s:g}s)", param="request_id")
    return entry
