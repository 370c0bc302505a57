"""Per-request timelines: enqueue -> scheduled -> first token -> finished.

Each finished request becomes one JSON log line on the ``rtx.requests`` logger (INFO), and, when the process has
configured an OpenTelemetry ``TracerProvider``, one span with a child span per stage. Neither ever carries prompt or
output text: only ids, token counts, timestamps and the attributes a server attached with :meth:`annotate`.

OpenTelemetry is never imported here unless a provider exists: if the application has not imported
``opentelemetry.trace`` it cannot have configured a provider, so there is nothing to emit to.
"""

from __future__ import annotations

import json
import logging
import re
import sys
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass

from rtxcore.engine.outputs import RequestOutput, RequestTimings

log = logging.getLogger("rtx.requests")

# W3C trace context: version-trace_id-parent_id-flags.
# W3C's limit on what a vendor may be sent is 512 characters; longer ones are dropped, not cut.
TRACESTATE_MAX_LEN = 512
_TRACEPARENT = re.compile(r"^[0-9a-f]{2}-([0-9a-f]{32})-([0-9a-f]{16})-[0-9a-f]{2}$")
# Annotations kept for requests that never reach the engine (refused after annotate) are dropped past this many.
_MAX_ANNOTATIONS = 65536

AttributeValue = str | int | float | bool


def read_timelines(lines: Iterable[str]) -> list[dict]:
    """The timelines in a server's log output (each ``rtx.requests`` line, whatever the log format put before its
    JSON); a line cut short, by the server's exit say, is skipped."""
    out = []
    for line in lines:
        start = line.find('{"event"')
        if start >= 0:
            try:
                out.append(json.loads(line[start:]))
            except ValueError:
                pass
    return out


def kept_tracestate(tracestate: str | None) -> str | None:
    """A caller's ``tracestate`` as passed on beside a valid traceparent: None when empty or past
    TRACESTATE_MAX_LEN."""
    return tracestate if tracestate and len(tracestate) <= TRACESTATE_MAX_LEN else None


@dataclass(slots=True, frozen=True)
class TraceHeaders:
    """The W3C trace context an engine request is traced under, as its headers: kept with a journaled request so
    that a restart resumes it in the same trace."""

    traceparent: str | None = None
    tracestate: str | None = None

    @classmethod
    def received(cls, traceparent: str | None, tracestate: str | None) -> TraceHeaders:
        """As a caller sent them: a ``traceparent`` that is not W3C's is dropped, and a ``tracestate`` is kept only
        beside a valid one and within TRACESTATE_MAX_LEN characters."""
        traceparent = traceparent.strip().lower() if traceparent else None
        if traceparent is None or not _TRACEPARENT.match(traceparent):
            return cls()
        return cls(traceparent, kept_tracestate(tracestate))

    @classmethod
    def from_json(cls, record: object) -> TraceHeaders:
        """From a journal record (None for one written before traces were kept).

        :raises TypeError: the record is not at most these two fields, each a string or None.
        """
        if record is None:
            return cls()
        if (not isinstance(record, dict) or not set(record) <= {"traceparent", "tracestate"}
                or not all(v is None or isinstance(v, str) for v in record.values())):
            raise TypeError(f"a trace record must hold a traceparent and a tracestate, each a string or null; got "
                            f"{record!r}")
        return cls(**record)


@dataclass(slots=True)
class _Annotation:
    traceparent: str | None
    tracestate: str | None
    attributes: dict[str, AttributeValue]


class RequestTimeline:
    def __init__(self, model_name: str):
        self.model_name = model_name
        self._annotations: dict[str, _Annotation] = {}
        self._lock = threading.Lock()
        # An OpenTelemetry TracerProvider to use instead of the global one (tests, embedding applications).
        self.tracer_provider: object = None
        self._tracer_for: object = None
        self._tracer: object = None

    def annotate(self, req_id: str, traceparent: str | None = None, tracestate: str | None = None,
                 **attributes: AttributeValue) -> None:
        """Attach a W3C trace context and attributes (e.g. ``request_id``) to ``req_id``; call before submitting.

        An invalid ``traceparent`` is ignored. Attributes must not hold prompt or output text.
        """
        if traceparent is not None:
            traceparent = traceparent.strip().lower()
            if not _TRACEPARENT.match(traceparent):
                traceparent = tracestate = None
        annotation = _Annotation(traceparent, tracestate, attributes)
        with self._lock:
            if len(self._annotations) >= _MAX_ANNOTATIONS:
                self._annotations.pop(next(iter(self._annotations)))
            self._annotations[req_id] = annotation

    def forget(self, req_id: str) -> None:
        """Drop ``req_id``'s annotation (a request refused before it reached the engine)."""
        with self._lock:
            self._annotations.pop(req_id, None)

    def record(self, out: RequestOutput, t: RequestTimings, enqueue_time: float) -> None:
        """Emit the timeline of a finished request (engine thread; ``t`` is its final output's timings, times
        monotonic)."""
        with self._lock:
            annotation = self._annotations.pop(out.req_id, None)
        tracer = self.tracer()
        if tracer is None and not log.isEnabledFor(logging.INFO):
            return
        # Monotonic -> wall clock, once per request.
        offset = time.time() - time.monotonic()
        if log.isEnabledFor(logging.INFO):
            record: dict[str, object] = {
                "event": "request_finished",
                "req_id": out.req_id,
                "model": self.model_name,
                "finish_reason": out.finish_reason,
                "num_prompt_tokens": out.num_prompt_tokens,
                "num_output_tokens": out.num_output_tokens,
                "num_cached_tokens": out.num_cached_tokens,
                "num_preemptions": t.num_preemptions,
                "enqueue": _wall(enqueue_time, offset),
                "admitted": _wall(t.arrival_time, offset),
                "scheduled": _wall(t.first_scheduled_time, offset),
                "first_token": _wall(t.first_token_time, offset),
                "finished": _wall(t.finish_time, offset),
                "queue_s": _span(enqueue_time, t.first_scheduled_time),
                "ttft_s": _span(enqueue_time, t.first_token_time),
                "e2e_s": _span(enqueue_time, t.finish_time),
            }
            if annotation is not None:
                match = annotation.traceparent and _TRACEPARENT.match(annotation.traceparent)
                if match:
                    record["trace_id"], record["parent_span_id"] = match.group(1), match.group(2)
                for key, value in annotation.attributes.items():
                    record.setdefault(key, value)
            log.info(json.dumps(record, separators=(",", ":")), extra={"rtx_request": record})
        if tracer is not None:
            _emit_spans(tracer, out, t, enqueue_time, offset, annotation, self.model_name)

    def tracer(self):
        """The tracer spans go to: from :attr:`tracer_provider`, else from the global provider once the application
        has configured a real one; None otherwise (no spans)."""
        provider = self.tracer_provider
        if provider is None:
            trace = sys.modules.get("opentelemetry.trace")
            if trace is None:
                return None
            provider = trace.get_tracer_provider()
            if isinstance(provider, (trace.ProxyTracerProvider, trace.NoOpTracerProvider)):
                return None
        if provider is not self._tracer_for:
            self._tracer_for, self._tracer = provider, provider.get_tracer("rtxcore")
        return self._tracer


def _wall(monotonic: float | None, offset: float) -> float | None:
    return None if monotonic is None else round(monotonic + offset, 6)


def _span(start: float, end: float | None) -> float | None:
    return None if end is None else round(end - start, 6)


def _emit_spans(tracer, out: RequestOutput, t: RequestTimings, enqueue_time: float, offset: float,
                annotation: _Annotation | None, model_name: str) -> None:
    from opentelemetry import trace
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    context = None
    if annotation is not None and annotation.traceparent:
        carrier = {"traceparent": annotation.traceparent}
        if annotation.tracestate:
            carrier["tracestate"] = annotation.tracestate
        context = TraceContextTextMapPropagator().extract(carrier)

    def ns(monotonic: float) -> int:
        return int((monotonic + offset) * 1e9)

    attributes: dict[str, AttributeValue] = {
        "rtx.req_id": out.req_id,
        "gen_ai.request.model": model_name,
        "gen_ai.usage.input_tokens": out.num_prompt_tokens,
        "gen_ai.usage.output_tokens": out.num_output_tokens,
        "rtx.finish_reason": out.finish_reason or "",
        "rtx.num_cached_tokens": out.num_cached_tokens,
        "rtx.num_preemptions": t.num_preemptions,
    }
    if annotation is not None:
        attributes.update({f"rtx.{k}": v for k, v in annotation.attributes.items()})
    span = tracer.start_span("rtx.request", context=context, start_time=ns(enqueue_time), attributes=attributes)
    inner = trace.set_span_in_context(span)
    stages = (("rtx.queue", enqueue_time, t.first_scheduled_time),
              ("rtx.prefill", t.first_scheduled_time, t.first_token_time),
              ("rtx.decode", t.first_token_time, t.finish_time))
    for name, start, end in stages:
        if start is not None and end is not None:
            tracer.start_span(name, context=inner, start_time=ns(start)).end(end_time=ns(end))
    span.end(end_time=ns(t.finish_time))
