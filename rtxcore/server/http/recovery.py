"""Start-up with a state dir: replay the journal, resume every request that had not finished, and make finished
ones within the retention window resumable again (``GET /v1/streams/{id}``, ``Idempotency-Key``).

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
from rtxcore.errors import AdmissionRefused, InvalidRequestError, RtxError
from rtxcore.metrics.timeline import TraceHeaders
from rtxcore.sampling_params import SamplingParams
from rtxcore.server.durable.entry import DurableRequest, IdempotencyClaim
from rtxcore.server.durable.journal import Journal
from rtxcore.server.durable.replay import JournaledRequest, group_records
from rtxcore.server.http.common import Route
from rtxcore.server.http.errors import APIError
from rtxcore.server.http.formats import FORMATS, ResponseSpec, make_format
from rtxcore.server.http.generation import Choice, Generation
from rtxcore.server.http.responding import conclude, produce
from rtxcore.server.http.sse import sse_json
from rtxcore.server.runtime import ServingRuntime

log = logging.getLogger("rtx.journal")


async def recover(runtime: ServingRuntime) -> None:
    """Open the journal and bring back its requests; the server refuses generations (503) until this is done."""
    durable = runtime.durable
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
            if not journaled.finish.get("void") and entry.finished_at >= expired_before:
                durable.add(entry)
                durable.stats.num_replayable += 1
            continue
        durable.add(entry)
        entry.producer = asyncio.ensure_future(_resume(runtime, entry, journaled))
        durable.stats.num_resumed += 1
    durable.recovered = True
    if durable.stats.num_resumed or durable.stats.num_replayable:
        log.info("journal: resumed %d unfinished requests; %d finished ones replayable", durable.stats.num_resumed,
                 durable.stats.num_replayable)


def _entry(journaled: JournaledRequest) -> DurableRequest:
    accept = journaled.accept
    claim = IdempotencyClaim(**accept["idempotency"]) if accept.get("idempotency") else None
    kind = FORMATS[accept["spec"]["kind"]]
    entry = DurableRequest(journaled.req_id, accept["tenant"], bool(accept["stream"]), claim, kind.ends_with_done,
                           kind=accept["spec"]["kind"], accepted_at=float(accept["time"]),
                           events=list(journaled.events))
    if journaled.finish is not None:
        finish = journaled.finish
        entry.finish(int(finish["status"]), finish.get("body"), at=float(finish["time"]))
    return entry


async def _resume(runtime: ServingRuntime, entry: DurableRequest, journaled: JournaledRequest) -> None:
    accept = journaled.accept
    journal = runtime.durable.journal
    try:
        if journaled.damaged:
            raise ValueError("an output record is missing")
        spec = ResponseSpec.from_json(accept["spec"])
        prompts: list[list[int]] = accept["prompts"]
        params = SamplingParams(**accept["params"])
        trace = TraceHeaders.from_json(accept.get("trace"))
        choices = [Choice(i, len(p)) for i, p in enumerate(prompts)]
        token_ids: list[list[int]] = [[] for _ in prompts]
        for output in journaled.outputs:
            choices[output["c"]].add(_request_output(output))
            token_ids[output["c"]].extend(output["tok"])
    except (KeyError, IndexError, TypeError, ValueError) as exc:  # damaged beyond what the checksums catch
        log.warning("journal: request %s has unreadable records (%r); ended with an error", entry.req_id, exc)
        _end_with_error(entry, journal, entry.stream, APIError(500, "the request could not be resumed after a "
                                                                    "restart: its journal records are damaged"))
        return
    tenant = runtime.tenants.tenants.get(accept["tenant"]) if accept["tenant"] is not None else None
    route = Route(tenant, accept["lane"], accept["cache_salt"])
    while True:
        try:
            gen = await Generation.resume(runtime, accept["gen_id"], prompts, params, route, choices, token_ids,
                                          "grpc" if spec.kind == "grpc" else "http", trace)
            break
        except AdmissionRefused as exc:  # the scheduler is full for now: it was accepted once, so it waits its turn
            await asyncio.sleep(max(0.05, exc.retry_after_s))
        except InvalidRequestError as exc:  # this server cannot run it any more (another model, a smaller context)
            log.warning("journal: request %s cannot be resumed: %s", entry.req_id, exc)
            _end_with_error(entry, journal, spec.stream, APIError.invalid(exc))
            return
        except RtxError as exc:  # the engine failed
            _end_with_error(entry, journal, spec.stream, APIError(500, str(exc)))
            return
    # A crash between the accept and the first event leaves no opening event (a chat stream's role chunk) yet.
    await produce(entry, gen, make_format(spec, runtime.async_engine.core.tokenizer), journal,
                  opening=not journaled.events)


def _end_with_error(entry: DurableRequest, journal: Journal, stream: bool, error: APIError) -> None:
    """What a failed request sends: an error event for a stream, an error response otherwise."""
    if stream:
        conclude(entry, journal, [sse_json(error.body())], 200, None)
    else:
        conclude(entry, journal, [], error.status, error.body())


def _request_output(output: dict[str, Any]) -> RequestOutput:
    logprobs = None
    if output.get("lp") is not None:
        logprobs = [TokenLogprob(t, lp, [(a, b) for a, b in top]) for t, lp, top in output["lp"]]
    finish_reason = output.get("fin")
    return RequestOutput("", list(output["tok"]), output["text"], finished=finish_reason is not None,
                         finish_reason=finish_reason, stop_reason=output.get("stop"), logprobs=logprobs,
                         num_cached_tokens=output.get("cached", 0))
