"""Engine metrics: a :class:`StepObserver` that turns each step's outputs into Prometheus samples and request
timelines.

Everything but :meth:`EngineMetrics.record_rejection`, :meth:`~EngineMetrics.record_timeout`,
:meth:`~EngineMetrics.annotate` and :meth:`~EngineMetrics.render` runs on the engine thread, once per step or per
request event, in O(outputs) (the fragmentation gauge walks the requests holding KV blocks).
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Histogram,
    ProcessCollector,
    disable_created_metrics,
    generate_latest,
)

from rtxcore.capacity.serving_path import PARTS, ServingPathRecorder
from rtxcore.capacity.step_time import SPREAD_QUANTILES, STEP_KINDS
from rtxcore.engine.async_engine import StepObserver
from rtxcore.engine.core import EngineCore
from rtxcore.engine.outputs import RequestOutput
from rtxcore.lanes import DEFAULT_LANE, LaneSpec
from rtxcore.metrics.prometheus import Families
from rtxcore.metrics.speculation import SpeculationMetrics
from rtxcore.metrics.timeline import AttributeValue, RequestTimeline
from rtxcore.request import Request

# No `<counter>_created` series: a timestamp per series that dashboards never read and that doubles the exposition
# of every counter and histogram (prometheus_client's switch is process-wide).
disable_created_metrics()

# Distinct tenant label values; further tenants are labelled "other".
MAX_TENANT_LABELS = 100
# Seconds between exports of the engine's step-time profile.
PROFILE_EXPORT_INTERVAL_S = 1.0


@dataclass(slots=True)
class _TokenStream:
    # When the request's previous token-carrying output was observed.
    last_token_time: float
    # Its lane's inter-token histogram and its tenant's token counter, looked up once per request.
    lane_itl: Histogram
    tenant_tokens: Counter


@dataclass(slots=True)
class _LiveRequest:
    # When the request was submitted (time.monotonic()): the start of queue time, TTFT and end-to-end latency.
    enqueue_time: float
    lane: str = DEFAULT_LANE
    tenant: str | None = None
    # Set at its first token: None before.
    stream: _TokenStream | None = None


class EngineMetrics:
    def __init__(self, model_name: str, registry: CollectorRegistry | None = None):
        if registry is None:
            registry = CollectorRegistry(auto_describe=True)
            # process_cpu_seconds_total, process_resident_memory_bytes, process_open_fds...: what vLLM exposes too.
            ProcessCollector(registry=registry)
        self.registry = registry
        self.model_name = model_name
        self.timeline = RequestTimeline(model_name)
        self._families = Families(self.registry)
        self._m = self._families.bind(model_name)
        self._speculation = SpeculationMetrics(self._families, model_name)
        # Requests in the engine, by req_id (engine thread only).
        self._live: dict[str, _LiveRequest] = {}
        # The serving side's part of time to first token (rtxcore.capacity.serving_path; event loop only).
        self.serving_path = ServingPathRecorder()
        self._next_path_export = 0.0
        # KV-cache counters at the previous step, to turn the manager's totals into counter increments.
        self._kv_for: object = None
        self._kv_totals = (0, 0, 0)
        self._next_profile_export = 0.0
        # (tier, counter) -> the total already added to the Prometheus counter.
        self._tier_totals: dict[tuple[str, int], float] = {}
        # Tenant label values handed out so far: bounded, so a config with many tenants cannot blow up the series.
        self._tenant_labels: set[str] = set()
        # The lanes whose targets are exported (kept to export them again under a new model label).
        self._lanes: list[LaneSpec] = []

    # -- what servers call ----------------------------------------------------------------------------------------

    def _on_hold(self, seconds: float) -> None:
        self._m.merge_window_hold.observe(seconds)

    def set_lane_targets(self, lanes: Iterable[LaneSpec]) -> None:
        """Export each lane's targets (rtx_lane_target_seconds), for dashboards to draw measured latency against."""
        self._lanes = list(lanes)
        for spec in self._lanes:
            self._families.lane_target.labels(self.model_name, spec.name, "ttft").set(spec.ttft_target_s)
            self._families.lane_target.labels(self.model_name, spec.name, "itl").set(spec.itl_target_s)

    def observer(self) -> StepObserver:
        return StepObserver(on_step=self._on_step, on_admit=self._on_admit, on_abort=self._on_abort,
                            on_idle=self._update_engine_state, on_hold=self._on_hold)

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
        self._speculation.relabel(name)
        self.set_lane_targets(self._lanes)  # dropped with the old label's series

    def record_rejection(self, reason: str, lane: str | None = None, tenant: str | None = None) -> None:
        """A request the server or scheduler refused (e.g. ``"overloaded"`` for a 429), with its lane and tenant
        when it got far enough to have them."""
        self._families.rejected.labels(self.model_name, reason).inc()
        if lane is not None:
            self._families.lane_requests.labels(self.model_name, lane, self.tenant_label(tenant), reason).inc()

    def record_admission(self, lane: str, tenant: str | None, num_requests: int = 1) -> None:
        """Requests the engine accepted, by lane and tenant."""
        self._families.lane_requests.labels(self.model_name, lane, self.tenant_label(tenant), "admitted").inc(
            num_requests)

    def tenant_label(self, tenant: str | None) -> str:
        """``tenant`` as a label value: ``anonymous`` without one, ``other`` past :data:`MAX_TENANT_LABELS`."""
        if tenant is None:
            return "anonymous"
        if tenant not in self._tenant_labels:
            if len(self._tenant_labels) >= MAX_TENANT_LABELS:
                return "other"
            self._tenant_labels.add(tenant)
        return tenant

    def record_timeout(self) -> None:
        """A request the server aborted for running past its timeout (its abort is counted by the engine too)."""
        self._m.timeouts.inc()

    def annotate(self, req_id: str, traceparent: str | None = None, tracestate: str | None = None,
                 **attributes: AttributeValue) -> None:
        """Attach a W3C trace context and attributes (e.g. ``request_id="..."``) to a request's timeline; call it
        before submitting the request. See :meth:`RequestTimeline.annotate`."""
        self.timeline.annotate(req_id, traceparent, tracestate, **attributes)

    def record_serving_path(self, ingress_s: float, delivery_s: float) -> None:
        """One request's time outside the engine before its first token (the servers' event loop)."""
        path = self.serving_path
        path.observe(ingress_s, delivery_s)
        now = time.monotonic()
        if path.ready and now >= self._next_path_export:
            # Sorted at most once a second, as the step-time spread is.
            self._next_path_export = now + PROFILE_EXPORT_INTERVAL_S
            for part in PARTS:
                for q, seconds in zip(SPREAD_QUANTILES, path.quantiles(part)):
                    self._families.serving_path.labels(self.model_name, part, str(q)).set(seconds)

    def forget(self, req_id: str) -> None:
        """Drop an annotation whose request was refused before reaching the engine."""
        self.timeline.forget(req_id)

    # -- the observer (engine thread) -----------------------------------------------------------------------------

    def _on_admit(self, req: Request, submitted_at: float, admitted_at: float) -> None:
        self._live[req.req_id] = _LiveRequest(submitted_at, req.lane, req.tenant)
        self._m.merge_wait.observe(admitted_at - submitted_at)

    def _on_step(self, engine: EngineCore, outputs: list[RequestOutput], step_seconds: float) -> None:
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

    def _on_abort(self, engine: EngineCore, out: RequestOutput) -> None:
        self._on_finished(out)
        self._update_engine_state(engine)

    def _on_tokens(self, engine: EngineCore, out: RequestOutput, now: float) -> None:
        live = self._live.get(out.req_id)
        if live is None:  # added to the engine directly, not through AsyncEngine.generate
            req = engine.requests.get(out.req_id)
            live = self._live[out.req_id] = _LiveRequest(self._arrival_time(engine, out),
                                                         req.lane if req is not None else DEFAULT_LANE,
                                                         req.tenant if req is not None else None)
        stream = live.stream
        if stream is None:
            req = engine.requests.get(out.req_id)
            if req is not None:
                first_token_time = req.first_token_time
            else:
                # Gone from the engine within the step of its first token: finished, so its last output has timings.
                assert out.timings is not None
                first_token_time = out.timings.first_token_time
            # The output processor stamps it on the request's first sampled token, before building this output.
            assert first_token_time is not None
            ttft = first_token_time - live.enqueue_time
            self._m.time_to_first_token.observe(ttft)
            f = self._families
            f.lane_time_to_first_token.labels(self.model_name, live.lane).observe(ttft)
            stream = live.stream = _TokenStream(
                now, f.lane_inter_token_latency.labels(self.model_name, live.lane),
                f.tenant_generation_tokens.labels(self.model_name, self.tenant_label(live.tenant)))
        else:
            self._m.inter_token_latency.observe(now - stream.last_token_time)
            stream.lane_itl.observe(now - stream.last_token_time)
            stream.last_token_time = now
        stream.tenant_tokens.inc(len(out.new_token_ids))

    def _on_finished(self, out: RequestOutput) -> None:
        m = self._m
        live = self._live.pop(out.req_id, None)
        t = out.timings
        reason = out.finish_reason or "abort"
        finished = m.finished.get(reason)
        if finished is None:
            finished = m.finished[reason] = self._families.finished.labels(self.model_name, reason)
        finished.inc()
        if out.error is not None:
            self._families.request_failures.labels(self.model_name, out.error.cause, out.error.plugin).inc()
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
        self.timeline.record(out, t, enqueue_time)

    def _update_engine_state(self, engine: EngineCore) -> None:
        m = self._m
        kv = engine.kv_cache
        m.requests_waiting.set(engine.scheduler.num_waiting)
        m.requests_running.set(engine.scheduler.num_running)
        status = engine.scheduler.status()
        if status is not None:
            f = self._families
            for lane, n in status.queued.items():
                f.lane_queued.labels(self.model_name, lane).set(n)
            for lane, n in status.running.items():
                f.lane_running.labels(self.model_name, lane).set(n)
            f.brownout_level.labels(self.model_name).set(status.brownout_level)
            f.brownout_pressure.labels(self.model_name).set(status.pressure)
            for lane, seconds in (status.predicted_ttft_s or {}).items():
                f.lane_predicted_ttft.labels(self.model_name, lane).set(seconds)
            if status.step_time is not None:
                f.step_time_model.labels(self.model_name, "base").set(status.step_time[0])
                f.step_time_model.labels(self.model_name, "per_token").set(status.step_time[1])
        recorder = engine.step_times
        now = time.monotonic()
        if recorder.ready and now >= self._next_profile_export:
            # Sorting the recent ratios for the spread costs about as much as a small GPU step's host work: once
            # a second is enough for a figure a planner reads after minutes of load.
            self._next_profile_export = now + PROFILE_EXPORT_INTERVAL_S
            base, per_row, per_token = recorder.coefficients()
            f = self._families
            f.step_time_profile.labels(self.model_name, "base").set(base)
            f.step_time_profile.labels(self.model_name, "per_row").set(per_row)
            f.step_time_profile.labels(self.model_name, "per_token").set(per_token)
            for kind in STEP_KINDS:
                for q, ratio in zip(SPREAD_QUANTILES, recorder.spread(kind)):
                    f.step_time_spread.labels(self.model_name, kind, str(q)).set(ratio)
            for rows, seconds in recorder.decodes.seconds().items():
                f.step_time_decode.labels(self.model_name, str(rows)).set(seconds)
        m.kv_cache_usage.set(kv.usage)
        m.kv_cache_fragmentation.set(kv.fragmentation)
        stats = kv.stats
        totals = (stats.num_prefix_query_tokens, stats.num_prefix_hit_tokens, stats.num_evictions)
        new_engine = kv is not self._kv_for
        if new_engine:  # first step, or another engine: its totals so far are new
            self._kv_for, self._kv_totals = kv, (0, 0, 0)
        queries, hits, evictions = (now - before for now, before in zip(totals, self._kv_totals))
        self._kv_totals = totals
        if queries:
            m.prefix_cache_queries.inc(queries)
        if hits:
            m.prefix_cache_hits.inc(hits)
        if evictions:
            m.kv_cache_evictions.inc(evictions)
        self._update_kv_tiers(engine, first=new_engine)
        self._add_total(self._families.out_of_memory, None, engine.faults.num_out_of_memory)
        self._speculation.update(engine.speculator)

    def _update_kv_tiers(self, engine: EngineCore, first: bool) -> None:
        f, model, kv = self._families, self.model_name, engine.kv_cache
        block_bytes = engine.backend.kv_cache_bytes_per_token() * kv.block_size
        f.kv_bytes_per_token.labels(model).set(engine.backend.kv_cache_bytes_per_token())
        pool = kv.pool
        f.kv_tier_capacity_bytes.labels(model, "device").set(pool.num_usable_blocks * block_bytes)
        f.kv_tier_used_bytes.labels(model, "device").set(pool.num_blocks_holding_data * block_bytes)
        f.kv_tier_usage.labels(model, "device").set(pool.num_blocks_holding_data / pool.num_usable_blocks)
        f.kv_tier_pressure.labels(model, "device").set(pool.pressure)
        if first:  # another engine: its running totals start again
            self._tier_totals.clear()
        if engine.kv_tiers is None:
            return
        for tier in engine.kv_tiers.tiers:
            name = tier.name
            f.kv_tier_capacity_bytes.labels(model, name).set(tier.capacity_bytes)
            f.kv_tier_used_bytes.labels(model, name).set(len(tier) * tier.block_bytes)
            f.kv_tier_usage.labels(model, name).set(tier.usage)
            f.kv_tier_pressure.labels(model, name).set(tier.pressure)
            st = tier.stats
            for family, total in ((f.kv_offload_blocks, st.num_stored),
                                  (f.kv_offload_bytes, st.num_stored * block_bytes),
                                  (f.kv_reload_blocks, st.num_loaded),
                                  (f.kv_reload_bytes, st.num_loaded * block_bytes),
                                  (f.kv_tier_evictions, st.num_evicted),
                                  (f.kv_tier_corrupt_blocks, st.num_corrupt),
                                  (f.kv_tier_skipped_blocks, st.num_skipped_busy)):
                self._add_total(family, name, total)
        self._add_total(f.kv_snapshot_blocks, None, engine.kv_tiers.num_snapshot_blocks)
        offload = engine.kv_tiers.offload
        self._add_total(f.kv_copy_wait_steps, None, offload.stats.num_copy_wait_steps)
        self._add_total(f.kv_copy_wait_seconds, None, offload.stats.copy_wait_seconds)
        self._add_total(f.kv_written_back_blocks, None, offload.stats.num_written_back)
        self._add_total(f.kv_prefetched_blocks, None, offload.stats.num_prefetched)
        self._add_total(f.kv_prefetch_promoted_blocks, None, offload.stats.num_prefetches_promoted)
        latency = f.kv_reload_latency.labels(model)
        while offload.reload_seconds:
            latency.observe(offload.reload_seconds.popleft())

    def _add_total(self, family, tier: str | None, total: float) -> None:
        """Bring a Prometheus counter up to a running total kept elsewhere."""
        key = (tier or "", id(family))
        child = family.labels(self.model_name, tier) if tier else family.labels(self.model_name)
        delta = total - self._tier_totals.get(key, 0)
        if delta > 0:
            child.inc(delta)
            self._tier_totals[key] = total

    @staticmethod
    def _arrival_time(engine: EngineCore, out: RequestOutput) -> float:
        req = engine.requests.get(out.req_id)
        if req is not None:
            return req.arrival_time
        # Gone from the engine by the time its output is observed: finished, so the output carries its timings.
        assert out.timings is not None
        return out.timings.arrival_time
