"""Start-up with a state dir: replay the journal, resume every request that had not finished, and make finished
ones within the retention window resumable again (``GET /v1/streams/{id}``, gRPC ``Resume``, ``Idempotency-Key``).

A resumed request is submitted again with its prompt and the tokens it had produced (the engine prefills both and
generates only what is left of ``max_tokens``); its events continue from the next sequence number, so a client that
reconnects with ``Last-Event-ID`` gets neither a duplicate nor a gap.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from rtxcore.engine.outputs import RequestOutput, TokenLogprob
from rtxcore.errors import AdmissionRefused, ErrorCode, InvalidRequestError, RequestError, RtxError
from rtxcore.metrics.timeline import TraceHeaders
from rtxcore.sampling_params import SamplingParams
from rtxcore.server.serving.durable.journal import Journal
from rtxcore.server.serving.durable.registry import DurableRequests
from rtxcore.server.serving.durable.replay import JournaledRequest, group_records
from rtxcore.server.serving.formats import FORMATS, ResponseSpec, event_text, make_format
from rtxcore.server.serving.generation import Choice, Generation, Speculation
from rtxcore.server.serving.lifecycle import cancelled_error, conclude, produce
from rtxcore.server.serving.routing import Route
from rtxcore.server.serving.runtime import ServingRuntime
from rtxcore.server.serving.served_request import IdempotencyClaim, ServedRequest

log = logging.getLogger("rtx.journal")


async def recover(runtime: ServingRuntime) -> None:
    """Open the journal and bring back its requests; the server refuses generations (503) until this is done."""
    durable = runtime.durable
    if durable is None:
        return
    try:
        records = await asyncio.to_thread(durable.journal.open)
    except OSError as exc:
        raise RtxError(f"cannot open the request journal in {durable.journal.directory}: {exc.strerror or exc}"
                       ) from None
    expired_before = time.time() - durable.options.retention_s
    for journaled in group_records(records):
        try:
            entry = _entry(journaled)
        except (KeyError, TypeError, ValueError) as exc:
            log.warning("journal: request %s has an unreadable accept record (%r); not resumed", journaled.req_id, exc)
            continue
        if journaled.finish is not None:
            if not journaled.finish.get("void") and (entry.finished_at or 0.0) >= expired_before:
                durable.add(entry)
                durable.stats.num_replayable += 1
            continue
        durable.add(entry)
        entry.producer = asyncio.ensure_future(_resume(runtime, durable, entry, journaled))
        durable.stats.num_resumed += 1
    durable.recovered = True
    if durable.stats.num_resumed or durable.stats.num_replayable:
        log.info("journal: resumed %d unfinished requests; %d finished ones replayable", durable.stats.num_resumed,
                 durable.stats.num_replayable)


def _entry(journaled: JournaledRequest) -> ServedRequest:
    accept = journaled.accept
    assert accept is not None  # group_records keeps only requests with an accept record
    claim = IdempotencyClaim(**accept["idempotency"]) if accept.get("idempotency") else None
    kind = FORMATS[accept["spec"]["kind"]]
    entry = ServedRequest(journaled.req_id, accept["tenant"], bool(accept["stream"]), claim, kind.ends_with_done,
                           kind=accept["spec"]["kind"], accepted_at=float(accept["time"]),
                           events=list(journaled.events))
    if journaled.finish is not None:
        finish = journaled.finish
        entry.finish(_finish_error(finish), finish.get("body"), at=float(finish["time"]))
    return entry


async def _resume(runtime: ServingRuntime, durable: DurableRequests, entry: ServedRequest,
                  journaled: JournaledRequest) -> None:
    accept = journaled.accept
    assert accept is not None  # group_records keeps only requests with an accept record
    journal = durable.journal
    try:
        if journaled.damaged:
            raise ValueError("an output record is missing")
        spec = ResponseSpec.from_json(accept["spec"])
        prompts: list[list[int]] = accept["prompts"]
        params = SamplingParams(**accept["params"])
        trace = TraceHeaders.from_json(accept.get("trace"))
        speculation = Speculation.from_json(accept)
        n = int(accept.get("n", 1))  # a record from before n existed: one choice per prompt
        choices = [Choice(i, len(p)) for i, p in enumerate(p for p in prompts for _ in range(n))]
        token_ids: list[list[int]] = [[] for _ in choices]
        for output in journaled.outputs:
            choices[output["c"]].add(_request_output(output))
            token_ids[output["c"]].extend(output["tok"])
    except (KeyError, IndexError, TypeError, ValueError) as exc:  # damaged beyond what the checksums catch
        log.warning("journal: request %s has unreadable records (%r); ended with an error", entry.req_id, exc)
        _end_with_error(entry, journal, ResponseSpec(entry.kind, entry.stream), RequestError(
            ErrorCode.INTERNAL, "the request could not be resumed after a restart: its journal records are damaged"))
        return
    tenant = runtime.tenants.tenants.get(accept["tenant"]) if accept["tenant"] is not None else None
    route = Route(tenant, accept["lane"], accept["cache_salt"])
    while True:
        if journaled.cancelled or entry.cancel_requested:  # its client stopped it: nothing to run again
            _end_with_error(entry, journal, spec, cancelled_error())
            return
        try:
            gen = await Generation.resume(runtime, accept["gen_id"], prompts, params, route, choices, token_ids, trace,
                                          "grpc" if spec.kind == "grpc" else "http", speculation, n)
            break
        except AdmissionRefused as exc:  # the scheduler is full for now: it was accepted once, so it waits its turn
            await asyncio.sleep(max(0.05, exc.retry_after_s or 0.0))
        except InvalidRequestError as exc:  # this server cannot run it any more (another model, a smaller context)
            log.warning("journal: request %s cannot be resumed: %s", entry.req_id, exc)
            _end_with_error(entry, journal, spec, exc)
            return
        except RtxError as exc:  # the engine failed
            _end_with_error(entry, journal, spec, RequestError(ErrorCode.INTERNAL, str(exc)))
            return
    entry.generation = gen
    if entry.cancel_requested:  # cancelled during the resume's last await
        try:
            await gen.cancel()
        except BaseException:
            gen.close()  # produce() would have: the engine requests, admission slots and lease go back
            raise
    # A crash between the accept and the first event leaves no opening event (a chat stream's role chunk) yet.
    await produce(entry, gen, make_format(spec, gen.tokenizer), journal,
                  opening=not journaled.events)


def _end_with_error(entry: ServedRequest, journal: Journal, spec: ResponseSpec, error: RequestError) -> None:
    """What a failed request sends: an error event for a stream, an error response otherwise."""
    fmt = make_format(spec, None)
    if spec.stream:
        conclude(entry, journal, [event_text(fmt.error_event(error))], error, None)
    else:
        conclude(entry, journal, [], error, fmt.error_body(error))


# The HTTP status a journal written before errors were recorded by code kept for a failed request.
_LEGACY_STATUS = {400: ErrorCode.INVALID_ARGUMENT, 401: ErrorCode.UNAUTHENTICATED, 403: ErrorCode.PERMISSION_DENIED,
                  404: ErrorCode.NOT_FOUND, 422: ErrorCode.CONFLICT, 429: ErrorCode.RESOURCE_EXHAUSTED,
                  503: ErrorCode.UNAVAILABLE, 504: ErrorCode.DEADLINE_EXCEEDED}


def _finish_error(finish: dict[str, Any]) -> RequestError | None:
    """What a finished request failed with, from its finish record (None: it succeeded)."""
    if finish.get("error") is not None:
        return RequestError.from_json(finish["error"])
    status = finish.get("status", 200)  # a journal from before errors were recorded by code
    if status == 200:
        return None
    body = finish.get("body") or {}
    message = body.get("error", {}).get("message", "the request failed") if isinstance(body, dict) else ""
    return RequestError(_LEGACY_STATUS.get(int(status), ErrorCode.INTERNAL), message)


def _request_output(output: dict[str, Any]) -> RequestOutput:
    logprobs = None
    if output.get("lp") is not None:
        logprobs = [TokenLogprob(t, lp, [(a, b) for a, b in top]) for t, lp, top in output["lp"]]
    finish_reason = output.get("fin")
    return RequestOutput("", list(output["tok"]), output["text"], finished=finish_reason is not None,
                         finish_reason=finish_reason, stop_reason=output.get("stop"), logprobs=logprobs,
                         num_cached_tokens=output.get("cached", 0))
