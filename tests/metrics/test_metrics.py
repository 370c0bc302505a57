"""Prometheus metrics and request timelines, from a real AsyncEngine on the tiny random-weight model."""

from __future__ import annotations

import asyncio
import json
import logging
import re

import pytest
from prometheus_client.parser import text_string_to_metric_families

from rtxcore.engine.async_engine import AsyncEngine
from rtxcore.metrics import EngineMetrics
from rtxcore.metrics.gpu import FAMILIES as GPU_FAMILIES
from rtxcore.metrics.timeline import TraceHeaders
from rtxcore.sampling_params import SamplingParams
from rtxcore.server.serving.durable.metrics import FAMILY_NAMES as DURABLE_FAMILIES
from tests.helpers import REPO
from tests.helpers.engines import make_engine

DOCS = REPO / "docs" / "metrics.md"
TRACEPARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


def documented_families() -> set[str]:
    """Family names from the tables of docs/metrics.md, as the text parser names them (counters lose ``_total``),
    but for those of a server with a state dir (rtxcore.server.serving.durable.metrics, checked below) and of one
    with a GPU (rtxcore.metrics.gpu)."""
    return _documented() - set(DURABLE_FAMILIES) - set(GPU_FAMILIES)


def _documented() -> set[str]:
    names = re.findall(r"^\| `(rtx_[a-z0-9_]+)` \|", DOCS.read_text(), flags=re.MULTILINE)
    return {name.removesuffix("_total") for name in names}


def test_gpu_families_are_documented_and_absent_without_a_gpu():
    from prometheus_client import CollectorRegistry

    from rtxcore.metrics.gpu import register_gpu_metrics

    assert set(GPU_FAMILIES) <= _documented()
    registry = CollectorRegistry()
    registered = register_gpu_metrics(registry)
    names = {family.name for family in registry.collect()}
    if registered:  # a machine with a GPU and its driver: every GPU has its three series
        assert names == set(GPU_FAMILIES)
        assert all(s.value >= 0 for family in registry.collect() for s in family.samples)
    else:
        assert names == set()


def parse(metrics: EngineMetrics) -> dict[str, dict[tuple, float]]:
    """``{family: {(sample name, sorted labels): value}}`` through Prometheus' own text parser (the engine's
    families: not the process_* ones)."""
    text, content_type = metrics.render()
    assert content_type.startswith("text/plain")
    families = {}
    for family in text_string_to_metric_families(text.decode()):
        if family.name.startswith("process_"):
            continue  # the process's own CPU time and memory, which move between any two readings
        families[family.name] = {(s.name, tuple(sorted(s.labels.items()))): s.value for s in family.samples}
    return families


def value(families, family: str, sample: str | None = None, **labels) -> float:
    """Sum of the family's samples named ``sample`` (default: the plain value) whose labels include ``labels``."""
    sample = sample or family
    return sum(v for (name, lbls), v in families[family].items()
               if name == sample and labels.items() <= dict(lbls).items())


async def collect(engine: AsyncEngine, prompt, params, req_id=None) -> int:
    n = 0
    async for out in engine.generate(prompt, params, req_id=req_id):
        n += len(out.new_token_ids)
    return n


async def leave_early(engine: AsyncEngine, prompt, max_tokens: int = 100) -> None:
    stream = engine.generate(prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    async for _ in stream:
        break
    await stream.aclose()


async def wait_idle(engine: AsyncEngine) -> None:
    for _ in range(500):
        if not engine.core.has_unfinished_requests() and engine.num_active == 0:
            return
        await asyncio.sleep(0.01)
    raise AssertionError("engine did not go idle")


@pytest.fixture
def served(registry, tmp_path):
    """An AsyncEngine with a tight KV cache (11 usable blocks of 16 tokens) over a host and a disk tier, observed
    by fresh metrics."""
    metrics = EngineMetrics("tiny")
    engine = AsyncEngine(make_engine(registry=registry, num_kv_blocks=12, kv_host_bytes=1 << 16,
                                     kv_disk_dir=str(tmp_path), kv_snapshot_interval_s=0.01).core,
                         observers=[metrics.observer()])
    engine.start()
    yield engine, metrics
    engine.stop()


def test_metrics_parse_and_every_family_moves(served):
    engine, metrics = served
    shared = list(range(3, 35))  # two full blocks shared by every prompt below: prefix-cache hits

    async def main():
        before = parse(metrics)
        # Six requests of up to 5 blocks each in an 11-block cache: the scheduler must preempt.
        params = SamplingParams(max_tokens=40, ignore_eos=True, temperature=0.0)
        counts = await asyncio.gather(*(collect(engine, shared + [100 + i] * 8, params) for i in range(6)),
                                      leave_early(engine, shared + [200] * 8))
        await wait_idle(engine)
        return before, counts

    before, counts = asyncio.run(main())
    metrics.record_rejection("overloaded")
    metrics.record_timeout()
    after = parse(metrics)

    assert documented_families() <= after.keys()
    assert counts[:6] == [40] * 6

    model = {"model": "tiny"}
    grew = {
        "rtx_time_to_first_token_seconds": "rtx_time_to_first_token_seconds_count",
        "rtx_inter_token_latency_seconds": "rtx_inter_token_latency_seconds_count",
        "rtx_e2e_request_latency_seconds": "rtx_e2e_request_latency_seconds_count",
        "rtx_request_queue_time_seconds": "rtx_request_queue_time_seconds_count",
        "rtx_merge_wait_seconds": "rtx_merge_wait_seconds_count",
        "rtx_batch_size": "rtx_batch_size_count",
        "rtx_engine_step_duration_seconds": "rtx_engine_step_duration_seconds_count",
        "rtx_engine_steps": "rtx_engine_steps_total",
        "rtx_prompt_tokens": "rtx_prompt_tokens_total",
        "rtx_generation_tokens": "rtx_generation_tokens_total",
        "rtx_prefix_cache_queries": "rtx_prefix_cache_queries_total",
        "rtx_prefix_cache_hits": "rtx_prefix_cache_hits_total",
        "rtx_request_preemptions": "rtx_request_preemptions_total",
        "rtx_request_aborts": "rtx_request_aborts_total",
        "rtx_requests_finished": "rtx_requests_finished_total",
        "rtx_requests_rejected": "rtx_requests_rejected_total",
        "rtx_request_timeouts": "rtx_request_timeouts_total",
        # Preemption evicts cached blocks: they go to the host tier; snapshots write them to disk.
        "rtx_kv_offload_blocks": "rtx_kv_offload_blocks_total",
        "rtx_kv_offload_bytes": "rtx_kv_offload_bytes_total",
        "rtx_kv_snapshot_blocks": "rtx_kv_snapshot_blocks_total",
    }
    for family, sample in grew.items():
        assert value(after, family, sample, **model) > value(before, family, sample, **model), family

    assert value(after, "rtx_time_to_first_token_seconds", "rtx_time_to_first_token_seconds_count") == 7
    assert value(after, "rtx_e2e_request_latency_seconds", "rtx_e2e_request_latency_seconds_count") == 6
    assert value(after, "rtx_requests_finished", "rtx_requests_finished_total", finish_reason="length") == 6
    assert value(after, "rtx_requests_finished", "rtx_requests_finished_total", finish_reason="abort") == 1
    assert value(after, "rtx_request_aborts", "rtx_request_aborts_total") == 1
    assert value(after, "rtx_prompt_tokens", "rtx_prompt_tokens_total") == 7 * 40
    generated = value(after, "rtx_generation_tokens", "rtx_generation_tokens_total")
    assert 6 * 40 < generated <= 6 * 40 + 100
    # One ITL observation per token after the first of each request.
    assert value(after, "rtx_inter_token_latency_seconds", "rtx_inter_token_latency_seconds_count") == generated - 7
    assert value(after, "rtx_requests_rejected", "rtx_requests_rejected_total", reason="overloaded") == 1
    assert value(after, "rtx_prefix_cache_hits", "rtx_prefix_cache_hits_total") <= value(
        after, "rtx_prefix_cache_queries", "rtx_prefix_cache_queries_total")
    block_bytes = value(after, "rtx_kv_bytes_per_token") * 16
    host_capacity = value(after, "rtx_kv_tier_capacity_bytes", tier="host")
    assert block_bytes > 0 and host_capacity == (1 << 16) // block_bytes * block_bytes
    assert value(after, "rtx_kv_offload_bytes", "rtx_kv_offload_bytes_total", tier="host") == block_bytes * value(
        after, "rtx_kv_offload_blocks", "rtx_kv_offload_blocks_total", tier="host")
    for tier in ("device", "host", "disk"):
        assert 0.0 <= value(after, "rtx_kv_tier_pressure_ratio", tier=tier) <= 1.0
        used = value(after, "rtx_kv_tier_used_bytes", tier=tier)
        assert used <= value(after, "rtx_kv_tier_capacity_bytes", tier=tier)
    # Histogram buckets are cumulative and end at the count.
    buckets = [v for (name, lbls), v in after["rtx_batch_size"].items() if name == "rtx_batch_size_bucket"]
    assert buckets == sorted(buckets) and buckets[-1] == value(after, "rtx_batch_size", "rtx_batch_size_count")

    # Idle again: gauges back to rest.
    for gauge in ("rtx_num_requests_waiting", "rtx_num_requests_running", "rtx_kv_cache_usage_ratio",
                  "rtx_kv_cache_fragmentation_ratio"):
        assert value(after, gauge, **model) == 0.0, gauge


def test_gauges_follow_the_engine_step_by_step(registry):
    """The observer driven by hand over a plain LLM: gauges are exact after each step."""
    engine = make_engine(registry=registry)
    metrics = EngineMetrics("tiny")
    observer = metrics.observer()
    engine.add_request(list(range(3, 23)), SamplingParams(max_tokens=3, ignore_eos=True), req_id="r")
    engine.add_request([3, 4, 5], SamplingParams(max_tokens=3, ignore_eos=True), req_id="s")
    observer.on_step(engine.core, engine.step(), 0.001)
    during = parse(metrics)
    assert value(during, "rtx_num_requests_running") == 2
    assert value(during, "rtx_kv_cache_usage_ratio") == pytest.approx(3 / engine.core.kv_cache.num_usable_blocks)
    # 20 and 3 tokens in 2 + 1 blocks of 16 slots: 25 of 48 slots empty.
    assert value(during, "rtx_kv_cache_fragmentation_ratio") == pytest.approx(25 / 48)
    assert value(during, "rtx_batch_size", "rtx_batch_size_sum") == 2
    while engine.has_unfinished_requests():
        observer.on_step(engine.core, engine.step(), 0.001)
    after = parse(metrics)
    assert value(after, "rtx_kv_cache_usage_ratio") == value(after, "rtx_kv_cache_fragmentation_ratio") == 0
    assert value(after, "rtx_num_requests_running") == 0
    assert value(after, "rtx_time_to_first_token_seconds", "rtx_time_to_first_token_seconds_count") == 2
    assert value(after, "rtx_inter_token_latency_seconds", "rtx_inter_token_latency_seconds_count") == 4
    assert value(after, "rtx_generation_tokens", "rtx_generation_tokens_total") == 6
    assert value(after, "rtx_prompt_tokens", "rtx_prompt_tokens_total") == 23
    assert value(after, "rtx_engine_steps", "rtx_engine_steps_total") == 3


def test_every_durable_restart_family_is_documented():
    names = re.findall(r"^\| `(rtx_[a-z0-9_]+)` \|", DOCS.read_text(), flags=re.MULTILINE)
    assert set(DURABLE_FAMILIES) <= {name.removesuffix("_total") for name in names}


def test_every_registered_family_is_documented():
    # The process_* families are prometheus_client's own (documented as a group, tested below).
    registered = {family.name for family in EngineMetrics("m").registry.collect()
                  if not family.name.startswith("process_")}
    documented = documented_families()
    assert registered == documented, (registered ^ documented)
    assert all(name.startswith("rtx_") for name in registered)


def test_model_label_follows_set_model_name():
    metrics = EngineMetrics("provisional")
    metrics.record_timeout()
    metrics.set_model_name("loaded")
    metrics.record_timeout()
    samples = parse(metrics)["rtx_request_timeouts"]
    assert {dict(lbls)["model"] for (name, lbls) in samples} == {"loaded"}
    assert value(parse(metrics), "rtx_request_timeouts", "rtx_request_timeouts_total") == 1


def test_registries_are_independent():
    a, b = EngineMetrics("a"), EngineMetrics("b")
    a.record_rejection("overloaded")
    assert value(parse(b), "rtx_requests_rejected", "rtx_requests_rejected_total") == 0


def test_timeline_log_line(served, caplog):
    engine, metrics = served
    metrics.annotate("timed", traceparent=TRACEPARENT, request_id="cmpl-42")
    with caplog.at_level(logging.INFO, logger="rtx.requests"):
        asyncio.run(collect(engine, [7, 8, 9, 10, 11], SamplingParams(max_tokens=6, ignore_eos=True),
                            req_id="timed"))
    lines = [r for r in caplog.records if r.name == "rtx.requests"]
    assert len(lines) == 1
    record = json.loads(lines[0].getMessage())
    assert record == lines[0].rtx_request
    assert record["req_id"] == "timed" and record["model"] == "tiny" and record["finish_reason"] == "length"
    stamps = [record[k] for k in ("enqueue", "admitted", "scheduled", "first_token", "finished")]
    assert all(isinstance(s, float) for s in stamps) and stamps == sorted(stamps)
    assert record["e2e_s"] >= record["ttft_s"] >= record["queue_s"] >= 0
    assert (record["num_prompt_tokens"], record["num_output_tokens"]) == (5, 6)
    assert record["trace_id"] == TRACEPARENT.split("-")[1] and record["request_id"] == "cmpl-42"
    assert not {"prompt", "text", "prompt_token_ids", "token_ids"} & record.keys()


def test_timeline_of_an_aborted_request(served, caplog):
    engine, metrics = served
    async def main():
        await leave_early(engine, [7, 8, 9])
        await wait_idle(engine)

    with caplog.at_level(logging.INFO, logger="rtx.requests"):
        asyncio.run(main())
    (line,) = [json.loads(r.getMessage()) for r in caplog.records if r.name == "rtx.requests"]
    assert line["finish_reason"] == "abort"
    assert line["enqueue"] <= line["first_token"] <= line["finished"]


def test_invalid_traceparent_is_ignored(served, caplog):
    engine, metrics = served
    metrics.annotate("bad", traceparent="not-a-trace", request_id="r1")
    with caplog.at_level(logging.INFO, logger="rtx.requests"):
        asyncio.run(collect(engine, [5, 6], SamplingParams(max_tokens=2, ignore_eos=True), req_id="bad"))
    (line,) = [json.loads(r.getMessage()) for r in caplog.records if r.name == "rtx.requests"]
    assert "trace_id" not in line and line["request_id"] == "r1"


def test_spans_when_a_tracer_provider_is_configured(served):
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import (
        InMemorySpanExporter,
    )

    engine, metrics = served
    assert metrics.timeline.tracer() is None  # nothing configured: no spans are built
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    # The global provider can be set only once per process; point the timeline at this one instead.
    metrics.timeline.tracer_provider = provider
    metrics.annotate("traced", traceparent=TRACEPARENT, request_id="cmpl-7")
    asyncio.run(collect(engine, [5, 6, 7, 8], SamplingParams(max_tokens=4, ignore_eos=True), req_id="traced"))

    spans = {span.name: span for span in exporter.get_finished_spans()}
    assert spans.keys() == {"rtx.request", "rtx.queue", "rtx.prefill", "rtx.decode"}
    root = spans["rtx.request"]
    assert format(root.context.trace_id, "032x") == TRACEPARENT.split("-")[1]
    assert format(root.parent.span_id, "016x") == TRACEPARENT.split("-")[2]
    assert root.attributes["rtx.request_id"] == "cmpl-7"
    assert root.attributes["gen_ai.usage.output_tokens"] == 4
    for name in ("rtx.queue", "rtx.prefill", "rtx.decode"):
        assert spans[name].parent.span_id == root.context.span_id
        assert root.start_time <= spans[name].start_time <= spans[name].end_time <= root.end_time


def test_trace_headers_as_received_and_as_journaled():
    parent = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
    assert TraceHeaders.received(parent.upper() + " ", "v=1") == TraceHeaders(parent, "v=1")
    # A tracestate rides only with a valid traceparent, and only within W3C's 512 characters.
    assert TraceHeaders.received(None, "v=1") == TraceHeaders.received("junk", "v=1") == TraceHeaders()
    assert TraceHeaders.received(parent, "v" * 513) == TraceHeaders(parent, None)
    # Journal records: none (written before traces were kept), or two optional strings; anything else is damage.
    assert TraceHeaders.from_json(None) == TraceHeaders()
    assert TraceHeaders.from_json({"traceparent": parent, "tracestate": None}) == TraceHeaders(parent)
    for damaged in ({"traceparent": 5}, {"span": parent}, [parent], "x"):
        with pytest.raises(TypeError, match="trace record"):
            TraceHeaders.from_json(damaged)


def test_exposition_has_process_metrics_and_no_created_series():
    from rtxcore.metrics import EngineMetrics

    body, _ = EngineMetrics("m").render()
    text = body.decode() if isinstance(body, bytes) else body
    assert "process_resident_memory_bytes" in text and "process_cpu_seconds_total" in text
    assert "_created" not in text


def test_merge_window_holds_are_timed_apart_from_the_inbox_wait(registry):
    """The sla-lanes scheduler holds a step open when requests arrive at an idle engine, so that others may join
    their prefill: each hold is observed, and lasts about the window. A window of 200 ms (2 ms by default) so that a
    busy machine's delay between a request's arrival and the next schedule cannot outlast it."""
    from rtxcore.contracts.scheduler import SchedulerConfig
    from rtxcore.engine.config import EngineConfig
    from rtxcore.engine.llm import LLM

    metrics = EngineMetrics("tiny")
    config = EngineConfig(model="dummy:tiny", scheduler="sla-lanes",
                          scheduling=SchedulerConfig(options={"merge_window_s": 0.2}))
    engine = AsyncEngine(LLM(config, registry=registry).core, observers=[metrics.observer()])
    engine.start()
    try:
        params = SamplingParams(max_tokens=4, ignore_eos=True, temperature=0.0)

        async def main():
            for i in range(3):  # one at a time: each finds the engine idle
                assert await collect(engine, [5, 6, 7, i], params) == 4
                await wait_idle(engine)
        asyncio.run(main())
    finally:
        engine.stop()
    families = parse(metrics)
    holds = value(families, "rtx_merge_window_hold_seconds", "rtx_merge_window_hold_seconds_count")
    held = value(families, "rtx_merge_window_hold_seconds", "rtx_merge_window_hold_seconds_sum")
    assert holds >= 3
    assert 0 < held / holds < 0.5  # at most the window, plus the thread's wake-up on a busy machine


def test_lane_targets_survive_the_model_label_changing():
    from rtxcore.lanes import DEFAULT_LANES

    metrics = EngineMetrics("provisional")
    metrics.set_lane_targets(DEFAULT_LANES.values())
    metrics.set_model_name("loaded")  # e.g. a GGUF file's name once the model is loaded: old series are dropped
    families = parse(metrics)
    for spec in DEFAULT_LANES.values():
        assert value(families, "rtx_lane_target_seconds", model="loaded", lane=spec.name,
                     latency="ttft") == spec.ttft_target_s
    assert {dict(lbls)["model"] for (_, lbls) in families["rtx_lane_target_seconds"]} == {"loaded"}
