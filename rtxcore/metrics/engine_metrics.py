"""Engine metrics: a :class:`StepObserver` that turns each step's outputs into Prometheus samples and request
timelines.

Everything but :meth:`EngineMetrics.record_rejection`, :meth:`~EngineMetrics.record_timeout`,
:meth:`~EngineMetrics.annotate` and :meth:`~EngineMetrics.render` runs on the engine thread, once per step or per
request event, in O(outputs) (the fragmentation gauge walks the requests holding KV blocks).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from rtxcore.engine.async_engine import StepObserver
from rtxcore.engine.llm_engine import LLMEngine
from rtxcore.engine.outputs import RequestOutput
from rtxcore.metrics.prometheus import Families
from rtxcore.metrics.timeline import AttributeValue, RequestTimeline


@dataclass(slots=True)
class _LiveRequest:
    # When the request was submitted (time.monotonic()): the start of queue time, TTFT and end-to-end latency.
    enqueue_time: float
    # When its previous token-carrying output was observed; None before the first token.
    last_token_time: float | None = None


class EngineMetrics:
    def __init__(self, model_name: str, registry: CollectorRegistry | None = None):
        self.registry = registry if registry is not None else CollectorRegistry(auto_describe=True)
        self.model_name = model_name
        self.timeline = RequestTimeline(model_name)
        self._families = Families(self.registry)
        self._m = self._families.bind(model_name)
        # Requests in the engine, by req_id (engine thread only).
        self._live: dict[str, _LiveRequest] = {}
        # KV-cache counters at the previous step, to turn the manager's totals into counter increments.
        self._kv_for: object = None
        self._kv_totals = (0, 0, 0)

    # -- what servers call ----------------------------------------------------------------------------------------

    def observer(self) -> StepObserver:
        return StepObserver(on_step=self._on_step, on_admit=self._on_admit, on_abort=self._on_abort)

    def render(self) -> tuple[bytes, str]:
        """The exposition text for ``GET /metrics`` and its content type."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST

    def set_model_name(self, name: str) -> None:
        """Set the ``model`` label (once the model is loaded, before the engine starts). Series recorded under the
        previous name are dropped."""
        if name == self.model_name:
            return
        self._families.clear()
        self.model_name = self.timeline.model_name = name
        self._m = self._families.bind(name)

    def record_rejection(self, reason: str) -> None:
        """A request the server refused before it reached the engine (e.g. ``"overloaded"`` for a 429)."""
        self._families.rejected.labels(self.model_name, reason).inc()

    def record_timeout(self) -> None:
        """A request the server aborted for running past its timeout (its abort is counted by the engine too)."""
        self._m.timeouts.inc()

    def annotate(self, req_id: str, traceparent: str | None = None, tracestate: str | None = None,
                 **attributes: AttributeValue) -> None:
        """Attach a W3C trace context and attributes (e.g. ``request_id="..."``) to a request's timeline; call it
        before submitting the request. See :meth:`RequestTimeline.annotate`."""
        self.timeline.annotate(req_id, traceparent, tracestate, **attributes)

    def forget(self, req_id: str) -> None:
        """Drop an annotation whose request was refused before reaching the engine."""
        self.timeline.forget(req_id)

    # -- the observer (engine thread) -----------------------------------------------------------------------------

    def _on_admit(self, req_id: str, submitted_at: float, admitted_at: float) -> None:
        self._live[req_id] = _LiveRequest(submitted_at)
        self._m.merge_wait.observe(admitted_at - submitted_at)

    def _on_step(self, engine: LLMEngine, outputs: list[RequestOutput], step_seconds: float) -> None:
        m = self._m
        m.engine_steps.inc()
        m.step_duration.observe(step_seconds)
        if outputs:
            now = time.monotonic()
            m.batch_size.observe(len(outputs))
            num_generated = 0
            for out in outputs:
                if out.new_token_ids:
                    num_generated += len(out.new_token_ids)
                    self._on_tokens(engine, out, now)
                if out.finished:
                    self._on_finished(out)
            if num_generated:
                m.generation_tokens.inc(num_generated)
        self._update_engine_state(engine)

    def _on_abort(self, engine: LLMEngine, out: RequestOutput) -> None:
        self._on_finished(out)
        self._update_engine_state(engine)

    def _on_tokens(self, engine: LLMEngine, out: RequestOutput, now: float) -> None:
        live = self._live.get(out.req_id)
        if live is None:  # added to the engine directly, not through AsyncEngine.generate
            live = self._live[out.req_id] = _LiveRequest(self._arrival_time(engine, out))
        if live.last_token_time is None:
            req = engine.requests.get(out.req_id)
            first_token_time = req.first_token_time if req is not None else out.timings.first_token_time
            self._m.time_to_first_token.observe(first_token_time - live.enqueue_time)
        else:
            self._m.inter_token_latency.observe(now - live.last_token_time)
        live.last_token_time = now

    def _on_finished(self, out: RequestOutput) -> None:
        m = self._m
        live = self._live.pop(out.req_id, None)
        t = out.timings
        reason = out.finish_reason or "abort"
        finished = m.finished.get(reason)
        if finished is None:
            finished = m.finished[reason] = self._families.finished.labels(self.model_name, reason)
        finished.inc()
        m.prompt_tokens.inc(out.num_prompt_tokens)
        if reason == "abort":
            m.aborts.inc()
        if t is None:
            return
        enqueue_time = live.enqueue_time if live is not None else t.arrival_time
        if t.num_preemptions:
            m.preemptions.inc(t.num_preemptions)
        if t.first_scheduled_time is not None:
            m.request_queue_time.observe(t.first_scheduled_time - enqueue_time)
        if reason != "abort":
            m.e2e_request_latency.observe(t.finish_time - enqueue_time)
        self.timeline.record(out, enqueue_time)

    def _update_engine_state(self, engine: LLMEngine) -> None:
        m = self._m
        kv = engine.kv_cache
        m.requests_waiting.set(engine.scheduler.num_waiting)
        m.requests_running.set(engine.scheduler.num_running)
        m.kv_cache_usage.set(kv.usage)
        m.kv_cache_fragmentation.set(kv.fragmentation)
        stats = kv.stats
        totals = (stats.num_prefix_query_tokens, stats.num_prefix_hit_tokens, stats.num_evictions)
        if kv is not self._kv_for:  # first step, or another engine: its totals so far are new
            self._kv_for, self._kv_totals = kv, (0, 0, 0)
        queries, hits, evictions = (now - before for now, before in zip(totals, self._kv_totals))
        self._kv_totals = totals
        if queries:
            m.prefix_cache_queries.inc(queries)
        if hits:
            m.prefix_cache_hits.inc(hits)
        if evictions:
            m.kv_cache_evictions.inc(evictions)

    @staticmethod
    def _arrival_time(engine: LLMEngine, out: RequestOutput) -> float:
        req = engine.requests.get(out.req_id)
        return req.arrival_time if req is not None else out.timings.arrival_time
