"""The Prometheus families the engine exports: every one is named ``rtx_*``, labelled ``model``, and documented in
``docs/metrics.md`` (a test checks that the two agree).

:class:`Families` creates them on one registry; :meth:`Families.bind` returns the children of one model label, which
is what the per-step observer touches, so a step costs no label lookups.
"""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

# Label every family carries; lane- and tenant-labelled families add LANE_LABEL / TENANT_LABEL.
MODEL_LABEL = "model"
LANE_LABEL = "lane"
TENANT_LABEL = "tenant"
PROPOSER_LABEL = "proposer"

# Seconds, from sub-millisecond GPU decode steps to multi-minute CPU generations.
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0,
                   20.0, 40.0, 80.0, 160.0, 320.0, 640.0)
# Per-token and per-step times: finer at the low end.
STEP_BUCKETS = (0.0005, 0.001, 0.002, 0.004, 0.006, 0.008, 0.01, 0.015, 0.02, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15,
                0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0)
# Time a submission sits in the engine's inbox: usually microseconds, up to a whole step.
MERGE_WAIT_BUCKETS = (0.00001, 0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25,
                      0.5, 1.0, 2.5, 5.0)
BATCH_SIZE_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512, 1024)
# Proposed tokens a verification accepted: one bucket per count up to the most a request may propose (16).
ACCEPTED_LENGTH_BUCKETS = tuple(float(n) for n in range(17))

FINISH_REASONS = ("stop", "length", "abort")


@dataclass(slots=True)
class BoundFamilies:
    """The children of one model label (see :class:`Families` for what each measures)."""

    time_to_first_token: Histogram
    inter_token_latency: Histogram
    e2e_request_latency: Histogram
    request_queue_time: Histogram
    merge_wait: Histogram
    merge_window_hold: Histogram
    batch_size: Histogram
    step_duration: Histogram
    engine_steps: Counter
    prompt_tokens: Counter
    generation_tokens: Counter
    prefix_cache_queries: Counter
    prefix_cache_hits: Counter
    kv_cache_evictions: Counter
    preemptions: Counter
    aborts: Counter
    timeouts: Counter
    out_of_memory: Counter
    requests_waiting: Gauge
    requests_running: Gauge
    kv_cache_usage: Gauge
    kv_cache_fragmentation: Gauge
    # finish_reason -> child of rtx_requests_finished_total.
    finished: dict[str, Counter]


class Families:
    def __init__(self, registry: CollectorRegistry):
        labels = (MODEL_LABEL,)
        # Every family, in creation order.
        self.all: list[Histogram | Counter | Gauge] = []

        def histogram(name: str, doc: str, buckets: tuple[float, ...], extra: tuple[str, ...] = ()) -> Histogram:
            family = Histogram(name, doc, labels + extra, buckets=buckets, registry=registry)
            self.all.append(family)
            return family

        def counter(name: str, doc: str, extra: tuple[str, ...] = ()) -> Counter:
            family = Counter(name, doc, labels + extra, registry=registry)
            self.all.append(family)
            return family

        def gauge(name: str, doc: str, extra: tuple[str, ...] = ()) -> Gauge:
            family = Gauge(name, doc, labels + extra, registry=registry)
            self.all.append(family)
            return family

        self.time_to_first_token = histogram(
            "rtx_time_to_first_token_seconds", "Seconds from a request's submission to its first generated token.",
            LATENCY_BUCKETS)
        self.inter_token_latency = histogram(
            "rtx_inter_token_latency_seconds", "Seconds between consecutive token-carrying outputs of a request.",
            STEP_BUCKETS)
        self.e2e_request_latency = histogram(
            "rtx_e2e_request_latency_seconds",
            "Seconds from a request's submission to its finish (stop or length; aborts excluded).", LATENCY_BUCKETS)
        self.request_queue_time = histogram(
            "rtx_request_queue_time_seconds", "Seconds from a request's submission to its first scheduled step.",
            LATENCY_BUCKETS)
        self.merge_wait = histogram(
            "rtx_merge_wait_seconds", "Seconds a submission waited before the engine thread added it to the scheduler.",
            MERGE_WAIT_BUCKETS)
        self.merge_window_hold = histogram(
            "rtx_merge_window_hold_seconds", "Seconds the engine held a step open so that arrivals could join it "
            "(a lane-aware scheduler's merge window), per hold.", MERGE_WAIT_BUCKETS)
        self.batch_size = histogram(
            "rtx_batch_size", "Requests that sampled a token in an engine step (steps that sampled none excluded).",
            BATCH_SIZE_BUCKETS)
        self.step_duration = histogram(
            "rtx_engine_step_duration_seconds", "Seconds one engine step took (schedule, execute, sample, update).",
            STEP_BUCKETS)
        self.engine_steps = counter("rtx_engine_steps", "Engine steps run.")
        self.prompt_tokens = counter(
            "rtx_prompt_tokens", "Prompt tokens of requests that finished or were aborted (counted once, at the end).")
        self.generation_tokens = counter("rtx_generation_tokens", "Tokens generated.")
        self.prefix_cache_queries = counter(
            "rtx_prefix_cache_queries", "Tokens looked up in the prefix cache when requests were scheduled.")
        self.prefix_cache_hits = counter(
            "rtx_prefix_cache_hits", "Of the tokens looked up in the prefix cache, those found (not recomputed).")
        self.kv_cache_evictions = counter(
            "rtx_kv_cache_evictions", "Cached KV blocks evicted to make room for new ones.")
        self.preemptions = counter(
            "rtx_request_preemptions", "Preemptions (KV freed, recomputed later), counted when the request ends.")
        self.aborts = counter(
            "rtx_request_aborts", "Requests aborted while in the engine (client gone, cancelled, timed out).")
        self.timeouts = counter("rtx_request_timeouts", "Requests the server aborted for running past its timeout.")
        self.out_of_memory = counter(
            "rtx_oom", "Backend steps that ran out of device memory (each attempt: a step is retried once).")
        self.finished = counter(
            "rtx_requests_finished", "Requests that left the engine, by finish reason (stop, length, abort, error).",
            ("finish_reason",))
        self.request_failures = counter(
            "rtx_request_failures", "Requests a plugin failed on alone (the others went on), by the kind of plugin "
            "at fault (sampler, logits_processor, detokenizer, proposer, backend) and its name.", ("cause", "plugin"))
        self.rejected = counter(
            "rtx_requests_rejected", "Requests the server refused before they reached the engine, by reason.",
            ("reason",))
        self.requests_waiting = gauge(
            "rtx_num_requests_waiting", "Requests queued in the scheduler, not running (preempted ones included).")
        self.requests_running = gauge("rtx_num_requests_running", "Requests holding KV cache and being stepped.")
        self.kv_cache_usage = gauge(
            "rtx_kv_cache_usage_ratio", "Fraction of usable KV blocks in use (evictable cached blocks count as free).")
        self.kv_cache_fragmentation = gauge(
            "rtx_kv_cache_fragmentation_ratio",
            "Fraction of the slots in KV blocks held by requests that hold no token (partly filled last blocks).")

        lane, tenant = (LANE_LABEL,), (TENANT_LABEL,)
        self.lane_time_to_first_token = histogram(
            "rtx_lane_time_to_first_token_seconds", "Time to first token by SLA lane.", LATENCY_BUCKETS, lane)
        self.lane_inter_token_latency = histogram(
            "rtx_lane_inter_token_latency_seconds", "Inter-token latency by SLA lane.", STEP_BUCKETS, lane)
        self.lane_requests = counter(
            "rtx_lane_requests", "Requests by lane, tenant and outcome: admitted, or the reason they were refused.",
            (LANE_LABEL, TENANT_LABEL, "outcome"))
        self.lane_queued = gauge("rtx_lane_requests_queued", "Requests queued per lane (lane-aware schedulers).", lane)
        self.lane_running = gauge("rtx_lane_requests_running", "Requests running per lane (lane-aware schedulers).",
                                  lane)
        self.lane_target = gauge(
            "rtx_lane_target_seconds", "Each lane's latency targets (the SLA): time to first token and inter-token "
            "latency.", (LANE_LABEL, "latency"))
        self.lane_predicted_ttft = gauge(
            "rtx_lane_predicted_ttft_seconds", "Time to first token the lane-aware scheduler predicts for a request "
            "of the lane's recent mean prompt length arriving now.", lane)
        self.step_time_model = gauge(
            "rtx_step_time_model_seconds", "The lane-aware scheduler's learnt step time, seconds = base + per_token x "
            "tokens: part=\"base\" and part=\"per_token\" (absent until it has seen enough steps).", ("part",))
        self.step_time_profile = gauge(
            "rtx_step_time_profile_seconds", "The engine's step time under its live load, for capacity planning "
            "(forgetting over about 500 steps), seconds = base + per_row x requests + per_token x tokens: "
            "part=\"base\", part=\"per_row\", part=\"per_token\".", ("part",))
        self.step_time_decode = gauge(
            "rtx_step_time_decode_seconds", "The engine's decode step time by batch size under its live load (one "
            "token per request; forgetting over about 500 steps of that size), where the profile's line would "
            "miss it: rows=\"N\".", ("rows",))
        self.step_time_spread = gauge(
            "rtx_step_time_spread_ratio", "Quantiles of recent steps' time over the step-time profile's prediction, "
            "per kind of step: kind=\"decode\" (one token per request), kind=\"other\" (a prefill chunk in it).",
            ("kind", "quantile"))
        self.serving_path = gauge(
            "rtx_serving_path_seconds", "Quantiles of recent requests' time outside the engine before their first "
            "token: part=\"ingress\" (arrival at the server to submission), part=\"delivery\" (first token sampled to "
            "held for sending).", ("part", "quantile"))
        self.brownout_level = gauge(
            "rtx_brownout_level", "Degradation steps in force (0: none; lane-aware schedulers with brownout).")
        self.brownout_pressure = gauge(
            "rtx_brownout_pressure", "Overload signal brownout acts on (1.0: a protected lane just meets its target).")
        self.tenant_generation_tokens = counter(
            "rtx_tenant_generation_tokens", "Tokens generated per tenant.", tenant)

        tier = ("tier",)
        self.kv_bytes_per_token = gauge(
            "rtx_kv_bytes_per_token", "KV-cache bytes one token takes across every layer and KV head.")
        self.kv_tier_capacity_bytes = gauge(
            "rtx_kv_tier_capacity_bytes", "Bytes of KV blocks each tier can hold (device, host, disk).", tier)
        self.kv_tier_used_bytes = gauge(
            "rtx_kv_tier_used_bytes", "Bytes of KV blocks each tier holds now (device: in use or cached).", tier)
        self.kv_tier_usage = gauge("rtx_kv_tier_usage_ratio", "Used over capacity, per tier.", tier)
        self.kv_tier_pressure = gauge(
            "rtx_kv_tier_pressure_ratio",
            "Share of recent insertions into a tier that had to evict a block (0: room to spare; 1: every new "
            "block pushes an old one out).", tier)
        self.kv_offload_blocks = counter(
            "rtx_kv_offload_blocks", "KV blocks written into a lower tier (from the device or the tier above).", tier)
        self.kv_offload_bytes = counter("rtx_kv_offload_bytes", "Bytes of rtx_kv_offload_blocks.", tier)
        self.kv_reload_blocks = counter(
            "rtx_kv_reload_blocks", "KV blocks brought back to the device from a lower tier for a prefix hit.", tier)
        self.kv_reload_bytes = counter("rtx_kv_reload_bytes", "Bytes of rtx_kv_reload_blocks.", tier)
        self.kv_tier_evictions = counter(
            "rtx_kv_tier_evictions", "KV blocks that left a lower tier to make room (moved down, or dropped at the "
            "bottom).", tier)
        self.kv_tier_corrupt_blocks = counter(
            "rtx_kv_tier_corrupt_blocks", "KV blocks found damaged when read back from a tier, and dropped.", tier)
        self.kv_tier_skipped_blocks = counter(
            "rtx_kv_tier_skipped_blocks", "KV blocks a tier did not store because its writes were too far behind (a "
            "disk slower than the spills); they are recomputed if asked for again.", tier)
        self.kv_snapshot_blocks = counter(
            "rtx_kv_snapshot_blocks", "KV blocks written to disk by warm-restart snapshots.")
        self.kv_reload_latency = histogram(
            "rtx_kv_reload_seconds", "Seconds from a prefix hit in a lower tier to its blocks' bytes being in place on "
            "the device (one sample per request's reload).", MERGE_WAIT_BUCKETS)
        self.kv_copy_wait_steps = counter(
            "rtx_kv_copy_wait_steps", "Engine steps that waited for KV blocks copied back from a lower tier (on a "
            "GPU: the step reached them before their copy ended; on a CPU: every step with a reload).")
        self.kv_copy_wait_seconds = counter(
            "rtx_kv_copy_wait_seconds", "Seconds those steps waited, in all.")
        self.kv_written_back_blocks = counter(
            "rtx_kv_written_back_blocks", "KV blocks copied from the device to the first lower tier ahead of their "
            "eviction, in batches (their eviction then copies nothing).")
        self.kv_prefetched_blocks = counter(
            "rtx_kv_prefetched_blocks", "KV blocks read from disk on worker threads, ahead of their reload.")
        self.kv_prefetch_promoted_blocks = counter(
            "rtx_kv_prefetch_promoted_blocks", "Of those, blocks no reload used (their request left, or ran without "
            "them), stored in the host tier instead.")

        proposer = (PROPOSER_LABEL,)
        self.spec_proposed_tokens = counter(
            "rtx_spec_proposed_tokens", "Tokens proposed by speculative decoding and verified, per proposer.", proposer)
        self.spec_accepted_tokens = counter(
            "rtx_spec_accepted_tokens", "Of the proposed tokens verified, those the model accepted, per proposer.",
            proposer)
        self.spec_verifications = counter(
            "rtx_spec_verifications", "Verifications: a request's proposed tokens checked in one step, per proposer.",
            proposer)
        self.spec_accepted_length = histogram(
            "rtx_spec_accepted_length", "Proposed tokens each verification accepted, per proposer.",
            ACCEPTED_LENGTH_BUCKETS, proposer)

    def bind(self, model: str) -> BoundFamilies:
        return BoundFamilies(
            time_to_first_token=self.time_to_first_token.labels(model),
            inter_token_latency=self.inter_token_latency.labels(model),
            e2e_request_latency=self.e2e_request_latency.labels(model),
            request_queue_time=self.request_queue_time.labels(model),
            merge_wait=self.merge_wait.labels(model),
            merge_window_hold=self.merge_window_hold.labels(model),
            batch_size=self.batch_size.labels(model),
            step_duration=self.step_duration.labels(model),
            engine_steps=self.engine_steps.labels(model),
            prompt_tokens=self.prompt_tokens.labels(model),
            generation_tokens=self.generation_tokens.labels(model),
            prefix_cache_queries=self.prefix_cache_queries.labels(model),
            prefix_cache_hits=self.prefix_cache_hits.labels(model),
            kv_cache_evictions=self.kv_cache_evictions.labels(model),
            preemptions=self.preemptions.labels(model),
            aborts=self.aborts.labels(model),
            timeouts=self.timeouts.labels(model),
            out_of_memory=self.out_of_memory.labels(model),
            requests_waiting=self.requests_waiting.labels(model),
            requests_running=self.requests_running.labels(model),
            kv_cache_usage=self.kv_cache_usage.labels(model),
            kv_cache_fragmentation=self.kv_cache_fragmentation.labels(model),
            finished={reason: self.finished.labels(model, reason) for reason in FINISH_REASONS},
        )

    def clear(self) -> None:
        """Drop every series (before binding another model label)."""
        for family in self.all:
            family.clear()
