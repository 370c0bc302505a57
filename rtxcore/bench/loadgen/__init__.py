"""Open-loop load against ``rtx serve``: lanes, tenants, Poisson or spiky arrivals, and what each request got.

Workload W5 of docs/workloads.md. A run has up to two phases:

1. capacity (unless a rate or a capacity is given): ``capacity_clients`` closed-loop clients send the same lane mix
   for ``capacity_duration_s``; capacity is completed requests per second;
2. load: requests are sent at arrival times drawn from a seed, whatever is still in flight (open loop), while
   ``GET /metrics`` is polled for the brownout level.

Every request ends in exactly one :class:`Outcome`. "Lost" means no outcome before the client's timeout: no HTTP
status, or a 200 stream that had not ended. Goodput counts completed requests that met their lane's targets, taken
from ``GET /v1/lanes`` when the server has it and from :attr:`LoadgenConfig.targets` otherwise.

    report = run_loadgen_sync(LoadgenConfig(url="http://127.0.0.1:8000", duration_s=30, load=1.5))
    print(report.table())
"""

from __future__ import annotations

import asyncio
import random
import time
from collections import Counter
from typing import Callable

import httpx

from rtxcore.bench.loadgen.probes import (
    BrownoutSample,
    LaneTargets,
    brownout_level,
    count_level_changes,
    fetch_lane_targets,
    poll_brownout,
)
from rtxcore.bench.loadgen.report import CapacityResult, LaneStats, LoadgenReport
from rtxcore.bench.loadgen.request import Outcome, RequestResult, send_request
from rtxcore.bench.loadgen.stats import percentile
from rtxcore.bench.loadgen.workload import (
    DEFAULT_LANES,
    DEFAULT_TARGETS,
    LaneProfile,
    LaneTarget,
    LengthRange,
    LoadgenConfig,
    PlannedRequest,
    PoissonArrivals,
    SpikyArrivals,
    Tenant,
    arrival_times,
    plan_requests,
    random_prompt,
    sample_request,
)
from rtxcore.errors import ConfigError, RtxError

__all__ = [
    "BrownoutSample", "CapacityResult", "DEFAULT_LANES", "DEFAULT_TARGETS", "LaneProfile", "LaneStats", "LaneTarget",
    "LaneTargets", "LengthRange", "LoadgenConfig", "LoadgenReport", "Outcome", "PlannedRequest", "PoissonArrivals",
    "RequestResult", "SpikyArrivals", "Tenant", "arrival_times", "brownout_level", "count_level_changes",
    "fetch_lane_targets", "make_client", "measure_capacity", "percentile", "plan_requests", "poll_brownout",
    "random_prompt", "run_loadgen", "run_loadgen_sync", "sample_request", "send_request",
]

# -- capacity ------------------------------------------------------------------------------------------------------


async def measure_capacity(config: LoadgenConfig) -> CapacityResult:
    """Closed loop: ``capacity_clients`` clients each send the next request when their last one ended."""
    async with make_client(config) as client:
        return await _measure_capacity(client, config)


async def _measure_capacity(client: httpx.AsyncClient, config: LoadgenConfig) -> CapacityResult:
    # Its own seed, so the capacity phase never replays the load phase's plan.
    plan_rng, prompt_rng = random.Random(config.seed + 1), random.Random()
    # (completed at, seconds since start) of each request that completed.
    completions: list[float] = []
    results: list[RequestResult] = []
    start = time.perf_counter()
    duration = config.capacity_duration_s
    # Steady state only: the first quarter fills the batch (every client's prefill at once), and requests still
    # running at the end are cut rather than waited for (a drain with fewer and fewer clients would understate
    # what the server sustains).
    warmup = duration / 4

    async def closed_loop_client() -> None:
        while True:
            planned = sample_request(plan_rng, config.lanes, config.tenants)
            prompt = random_prompt(planned.num_prompt_tokens, config.token_id_range, prompt_rng)
            result = await send_request(client, config, planned, prompt, time.perf_counter() - start)
            results.append(result)
            if result.outcome is Outcome.COMPLETED:
                completions.append(time.perf_counter() - start)
            else:  # a refused client waits as told instead of spinning
                await asyncio.sleep(min(result.retry_after_s or 0.1, duration))

    clients = [asyncio.ensure_future(closed_loop_client()) for _ in range(config.capacity_clients)]
    await asyncio.sleep(duration)
    for task in clients:
        task.cancel()
    await asyncio.gather(*clients, return_exceptions=True)
    num_completed = sum(1 for t in completions if warmup <= t <= duration)
    if num_completed == 0:
        reasons = Counter(r.error or r.outcome.value for r in results).most_common(1)
        raise RtxError(f"no request completed in the steady part ({warmup:g}-{duration:g}s) of measuring capacity "
                       f"({len(results)} ended{'; ' + reasons[0][0] if reasons else ''}); measure for longer")
    return CapacityResult(num_completed / (duration - warmup), config.capacity_clients, len(results),
                          num_completed, duration - warmup)


# -- the run -------------------------------------------------------------------------------------------------------


def make_client(config: LoadgenConfig) -> httpx.AsyncClient:
    # No httpx timeout: each request's whole exchange is bounded by request_timeout_s instead. trust_env=False: a
    # proxy from the environment would sit between the load and the server it measures.
    limits = httpx.Limits(max_connections=config.max_connections, max_keepalive_connections=config.max_connections)
    return httpx.AsyncClient(timeout=None, limits=limits, trust_env=False)


async def run_loadgen(config: LoadgenConfig, log: Callable[[str], None] | None = None,
                      progress: Callable[[int, int], None] | None = None) -> LoadgenReport:
    """Measure capacity if needed, then offer the load; ``log`` receives a line as each phase starts and ends.

    :param progress: called as ``progress(num_ended, num_planned)`` in the load phase: with 0 as it starts, then
        as each request ends.
    :raises RtxError: the server cannot be reached, or completed nothing while capacity was measured.
    """
    say = log or (lambda line: None)
    async with make_client(config) as client:
        targets = await fetch_lane_targets(client, config)
        untargeted = [lane.name for lane in config.lanes if lane.name not in targets.by_lane]
        if untargeted:
            raise ConfigError(f"lane {untargeted[0]} has no targets: the server does not list it and none were "
                              f"given (--target {untargeted[0]}=TTFT_S:ITL_S)")
        measurement = None
        capacity = config.capacity
        if config.rate is not None:
            base_rate = config.rate
        else:
            if capacity is None:
                say(f"measuring capacity: {config.capacity_clients} closed-loop clients for "
                    f"{config.capacity_duration_s:g}s...")
                measurement = await _measure_capacity(client, config)
                capacity = measurement.requests_per_s
                say(f"capacity {capacity:.3g} req/s ({measurement.num_completed} completed in "
                    f"{measurement.elapsed_s:.1f}s)")
            # LoadgenConfig.__post_init__ sets load (1.0 by default) whenever no rate is given.
            assert config.load is not None
            base_rate = config.load * capacity
        plan = plan_requests(config, base_rate)
        say(f"offering {base_rate:.3g} req/s, {config.pattern.describe()}, for {config.duration_s:g}s: "
            f"{len(plan)} requests")
        results, samples, max_lag = await _open_loop(client, config, plan, progress)
    lanes = [LaneStats.from_results(lane.name, [r for r in results if r.lane == lane.name], targets.by_lane,
                                    config.duration_s) for lane in config.lanes]
    overall = LaneStats.from_results("all", results, targets.by_lane, config.duration_s)
    return LoadgenReport(config.url, config.pattern, base_rate, config.load if config.rate is None else None,
                         config.duration_s, config.seed, capacity if config.rate is None else None, measurement,
                         targets, lanes, overall, samples, max_lag, results)


async def _open_loop(client: httpx.AsyncClient, config: LoadgenConfig, plan: list[PlannedRequest],
                     progress: Callable[[int, int], None] | None = None
                     ) -> tuple[list[RequestResult], list[BrownoutSample], float]:
    # Prompt contents come from fresh entropy: a second run with the same seed must not hit the first one's
    # prompts in the prefix cache. The plan (times, lanes, lengths) stays reproducible.
    prompt_rng = random.Random()
    samples: list[BrownoutSample] = []
    stop = asyncio.Event()
    origin = time.perf_counter()
    poller = asyncio.ensure_future(poll_brownout(client, config, origin, samples, stop))
    tasks: list[asyncio.Future[RequestResult]] = []
    max_lag = 0.0
    num_ended = 0
    if progress is not None:
        progress(0, len(plan))

    def one_ended(_: asyncio.Future) -> None:
        nonlocal num_ended
        num_ended += 1
        if progress is not None:
            progress(num_ended, len(plan))
    try:
        for planned in plan:
            prompt = random_prompt(planned.num_prompt_tokens, config.token_id_range, prompt_rng)
            delay = origin + planned.send_at_s - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            now = time.perf_counter() - origin
            max_lag = max(max_lag, now - planned.send_at_s)
            tasks.append(asyncio.ensure_future(send_request(client, config, planned, prompt, now)))
            tasks[-1].add_done_callback(one_ended)
        results = list(await asyncio.gather(*tasks))
    finally:
        for task in tasks:  # only when interrupted: gather has finished them otherwise
            task.cancel()
        stop.set()
        await poller
    return results, samples, max_lag


def run_loadgen_sync(config: LoadgenConfig, log: Callable[[str], None] | None = None,
                     progress: Callable[[int, int], None] | None = None) -> LoadgenReport:
    return asyncio.run(run_loadgen(config, log, progress))
