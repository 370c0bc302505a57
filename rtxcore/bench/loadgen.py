"""Open-loop load against ``rtx serve``: lanes, tenants, Poisson or spiky arrivals, and what each request got.

Workload W5 of shared/WORKLOADS.md. A run has up to two phases:

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
import enum
import itertools
import json
import math
import random
import re
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable

import httpx

from rtxcore.errors import ConfigError, RtxError

LANE_HEADER = "x-rtx-lane"


# -- what is sent --------------------------------------------------------------------------------------------------


@dataclass(slots=True, frozen=True)
class LengthRange:
    """Token counts drawn uniformly from ``[low, high]``, both ends included."""

    low: int
    high: int

    def __post_init__(self) -> None:
        if not 1 <= self.low <= self.high:
            raise ConfigError(f"a length range needs 1 <= low <= high, got {self.low}:{self.high}")

    def sample(self, rng: random.Random) -> int:
        return rng.randint(self.low, self.high)


@dataclass(slots=True, frozen=True)
class LaneProfile:
    """One lane of the mix: how often it is picked and how long its prompts and outputs are."""

    name: str
    # Relative; the mix is normalized over all lanes.
    weight: float
    prompt_tokens: LengthRange
    output_tokens: LengthRange

    def __post_init__(self) -> None:
        if not self.name:
            raise ConfigError("a lane needs a name")
        if not self.weight > 0:
            raise ConfigError(f"lane {self.name}: weight must be > 0, got {self.weight}")


@dataclass(slots=True, frozen=True)
class LaneTarget:
    """What a request of a lane must meet to count as goodput."""

    ttft_s: float
    # Compared with the p95 of the request's own inter-token gaps.
    itl_s: float

    def __post_init__(self) -> None:
        if not (self.ttft_s > 0 and self.itl_s > 0):
            raise ConfigError(f"lane targets must be > 0, got ttft {self.ttft_s} and itl {self.itl_s}")


@dataclass(slots=True, frozen=True)
class Tenant:
    name: str
    api_key: str
    weight: float = 1.0

    def __post_init__(self) -> None:
        if not self.name or not self.api_key:
            raise ConfigError("a tenant needs a name and a key")
        if not self.weight > 0:
            raise ConfigError(f"tenant {self.name}: weight must be > 0, got {self.weight}")


# Sized for the CPU default model on 2 cores (shared/WORKLOADS.md, CPU variants): short realtime requests, long bulk.
DEFAULT_LANES: tuple[LaneProfile, ...] = (
    LaneProfile("realtime", 0.1, LengthRange(16, 64), LengthRange(16, 32)),
    LaneProfile("standard", 0.6, LengthRange(32, 128), LengthRange(32, 96)),
    LaneProfile("bulk", 0.3, LengthRange(128, 256), LengthRange(64, 128)),
)
# Used only when the server does not publish its own (GET /v1/lanes answers 404); the same as the server's defaults
# for the default model on a small CPU, so that a report means the same either way.
DEFAULT_TARGETS: dict[str, LaneTarget] = {
    "realtime": LaneTarget(ttft_s=1.0, itl_s=0.25),
    "standard": LaneTarget(ttft_s=4.0, itl_s=0.5),
    "bulk": LaneTarget(ttft_s=30.0, itl_s=2.0),
}


# -- when it is sent -----------------------------------------------------------------------------------------------


@dataclass(slots=True, frozen=True)
class PoissonArrivals:
    """A constant rate: exponential gaps between arrivals."""

    def rate_factor(self, t_s: float) -> float:
        return 1.0

    @property
    def peak_factor(self) -> float:
        return 1.0

    def describe(self) -> str:
        return "poisson"

    def to_json(self) -> dict[str, Any]:
        return {"name": "poisson"}


@dataclass(slots=True, frozen=True)
class SpikyArrivals:
    """Poisson at the base rate, times ``factor`` during ``[start_s + k * period_s, ... + spike_len_s)``.

    The first spike starts after ``start_s`` so that a run shows the server before, during and after a spike.
    """

    factor: float = 3.0
    spike_len_s: float = 10.0
    period_s: float = 60.0
    start_s: float = 20.0

    def __post_init__(self) -> None:
        if not self.factor >= 1:
            raise ConfigError(f"spike factor must be >= 1, got {self.factor}")
        if not 0 < self.spike_len_s <= self.period_s:
            raise ConfigError(f"spike length must be in (0, period], got {self.spike_len_s} with period "
                              f"{self.period_s}")
        if self.start_s < 0:
            raise ConfigError(f"spike start must be >= 0, got {self.start_s}")

    def in_spike(self, t_s: float) -> bool:
        return t_s >= self.start_s and (t_s - self.start_s) % self.period_s < self.spike_len_s

    def rate_factor(self, t_s: float) -> float:
        return self.factor if self.in_spike(t_s) else 1.0

    @property
    def peak_factor(self) -> float:
        return self.factor

    def describe(self) -> str:
        return (f"spiky ({self.factor:g}x for {self.spike_len_s:g}s every {self.period_s:g}s from "
                f"{self.start_s:g}s)")

    def to_json(self) -> dict[str, Any]:
        return {"name": "spiky", "factor": self.factor, "spike_len_s": self.spike_len_s, "period_s": self.period_s,
                "start_s": self.start_s}


ArrivalPattern = PoissonArrivals | SpikyArrivals


def arrival_times(pattern: ArrivalPattern, base_rate: float, duration_s: float, rng: random.Random) -> list[float]:
    """Seconds from the start at which requests arrive, in ``[0, duration_s)``.

    Thinning (Lewis and Shedler): candidates at the peak rate, each kept with probability rate(t) / peak, which is
    exact for a rate that changes in steps.
    """
    peak = base_rate * pattern.peak_factor
    times: list[float] = []
    t = rng.expovariate(peak)
    while t < duration_s:
        if rng.random() * pattern.peak_factor < pattern.rate_factor(t):
            times.append(t)
        t += rng.expovariate(peak)
    return times


@dataclass(slots=True, frozen=True)
class PlannedRequest:
    # Seconds after the start of the phase at which it is sent.
    send_at_s: float
    lane: str
    # None: no Authorization header.
    tenant: Tenant | None
    num_prompt_tokens: int
    max_tokens: int


def sample_request(rng: random.Random, lanes: tuple[LaneProfile, ...], tenants: tuple[Tenant, ...],
                   send_at_s: float = 0.0) -> PlannedRequest:
    lane = rng.choices(lanes, weights=[lane.weight for lane in lanes])[0]
    tenant = rng.choices(tenants, weights=[t.weight for t in tenants])[0] if tenants else None
    return PlannedRequest(send_at_s, lane.name, tenant, lane.prompt_tokens.sample(rng),
                          lane.output_tokens.sample(rng))


def plan_requests(config: LoadgenConfig, base_rate: float) -> list[PlannedRequest]:
    """The load phase's requests; the same seed gives the same plan."""
    rng = random.Random(config.seed)
    times = arrival_times(config.pattern, base_rate, config.duration_s, rng)
    return [sample_request(rng, config.lanes, config.tenants, t) for t in times]


def random_prompt(num_tokens: int, token_id_range: tuple[int, int], rng: random.Random) -> list[int]:
    """Random token ids: exact lengths, and no prefix-cache hits between requests (a 16-token block of random ids
    repeats with negligible probability)."""
    low, high = token_id_range
    return [rng.randrange(low, high) for _ in range(num_tokens)]


# -- the configuration ---------------------------------------------------------------------------------------------


@dataclass(slots=True)
class LoadgenConfig:
    url: str = "http://127.0.0.1:8000"
    # Length of the load phase's arrival window; in-flight requests are then waited for.
    duration_s: float = 30.0
    # The base rate is ``rate`` (requests/s) when given, else ``load`` times capacity (load 1.0 when neither is).
    rate: float | None = None
    load: float | None = None
    # Known capacity (requests/s): skips the capacity phase.
    capacity: float | None = None
    pattern: ArrivalPattern = field(default_factory=PoissonArrivals)
    lanes: tuple[LaneProfile, ...] = DEFAULT_LANES
    # Fallback lane targets; the server's GET /v1/lanes wins for the lanes it lists.
    targets: dict[str, LaneTarget] = field(default_factory=lambda: dict(DEFAULT_TARGETS))
    # Empty: requests carry no Authorization header.
    tenants: tuple[Tenant, ...] = ()
    capacity_clients: int = 8
    capacity_duration_s: float = 20.0
    # Per request, from send to the end of the stream.
    request_timeout_s: float = 60.0
    metrics_interval_s: float = 0.5
    seed: int = 0
    # Prompt token ids are drawn from [low, high): inside every built-in vocabulary (dummy:tiny has 512) and above
    # the special tokens at its start.
    token_id_range: tuple[int, int] = (100, 500)
    # Ask for logprobs so every chunk names its tokens: models without a tokenizer stream no text to time.
    logprobs: bool = False
    # None: the served model.
    model: str | None = None
    # Open loop: enough that a connection is never waited for.
    max_connections: int = 4096

    def __post_init__(self) -> None:
        if not self.url.startswith(("http://", "https://")):
            raise ConfigError(f"url must start with http:// or https://, got {self.url!r}")
        self.url = self.url.rstrip("/")
        if self.rate is not None and self.load is not None:
            raise ConfigError("give either a rate or a load (a multiple of capacity), not both")
        if self.rate is None and self.load is None:
            self.load = 1.0
        for name in ("duration_s", "rate", "load", "capacity", "capacity_duration_s", "request_timeout_s",
                     "metrics_interval_s"):
            value = getattr(self, name)
            if value is not None and not (value > 0 and math.isfinite(value)):
                raise ConfigError(f"{name} must be a positive number, got {value}")
        if self.capacity_clients < 1 or self.max_connections < 1:
            raise ConfigError("capacity_clients and max_connections must be at least 1")
        if not self.lanes:
            raise ConfigError("the lane mix is empty")
        names = [lane.name for lane in self.lanes]
        if len(set(names)) != len(names):
            raise ConfigError(f"lane names repeat: {', '.join(names)}")
        tenant_names = [t.name for t in self.tenants]
        if len(set(tenant_names)) != len(tenant_names):
            raise ConfigError(f"tenant names repeat: {', '.join(tenant_names)}")
        low, high = self.token_id_range
        if not 0 <= low < high:
            raise ConfigError(f"token id range needs 0 <= low < high, got {low}:{high}")


# -- one request ---------------------------------------------------------------------------------------------------


class Outcome(enum.Enum):
    COMPLETED = "completed"
    REJECTED_429 = "rejected_429"
    # A 5xx status, or an error event inside a 200 stream (the server's 500/504 once headers were sent).
    ERROR_5XX = "errors_5xx"
    # Another 4xx, a connection error, or a stream that ended without [DONE] and a finish reason.
    ERROR_OTHER = "errors_other"
    # Nothing came back before the client timeout: no status, or a 200 stream still open.
    LOST = "lost"


@dataclass(slots=True)
class RequestResult:
    lane: str
    tenant: str | None
    sent_at_s: float
    max_tokens: int
    outcome: Outcome = Outcome.LOST
    status: int | None = None
    ttft_s: float | None = None
    # Gaps between consecutive content chunks.
    itl_s: list[float] = field(default_factory=list)
    completion_tokens: int = 0
    finish_reason: str | None = None
    saw_done: bool = False
    # The 429's Retry-After in seconds; None when absent or not a number of seconds.
    retry_after_s: float | None = None
    error: str | None = None

    @property
    def itl_p95_s(self) -> float | None:
        return percentile(self.itl_s, 95)

    def is_good(self, target: LaneTarget) -> bool:
        if self.outcome is not Outcome.COMPLETED or self.ttft_s is None or self.ttft_s > target.ttft_s:
            return False
        itl = self.itl_p95_s
        return itl is None or itl <= target.itl_s  # one content chunk has no gaps to judge

    def to_json(self) -> dict[str, Any]:
        return {"lane": self.lane, "tenant": self.tenant, "sent_at_s": _round(self.sent_at_s),
                "outcome": self.outcome.value, "status": self.status, "ttft_s": _round(self.ttft_s),
                "itl_p95_s": _round(self.itl_p95_s), "max_tokens": self.max_tokens,
                "completion_tokens": self.completion_tokens,
                "finish_reason": self.finish_reason, "retry_after_s": self.retry_after_s, "error": self.error}


async def send_request(client: httpx.AsyncClient, config: LoadgenConfig, planned: PlannedRequest,
                       prompt_token_ids: list[int], sent_at_s: float) -> RequestResult:
    """POST one streaming completion and record what came back; never raises for what the server does."""
    body: dict[str, Any] = {"prompt": prompt_token_ids, "max_tokens": planned.max_tokens, "stream": True,
                            "ignore_eos": True, "stream_options": {"include_usage": True}}
    if config.model is not None:
        body["model"] = config.model
    if config.logprobs:
        body["logprobs"] = 0
    headers = {LANE_HEADER: planned.lane}
    if planned.tenant is not None:
        headers["Authorization"] = f"Bearer {planned.tenant.api_key}"
    result = RequestResult(planned.lane, planned.tenant.name if planned.tenant else None, sent_at_s,
                           planned.max_tokens)
    start = time.perf_counter()
    try:
        async with asyncio.timeout(config.request_timeout_s):
            async with client.stream("POST", config.url + "/v1/completions", json=body, headers=headers) as resp:
                result.status = resp.status_code
                if resp.status_code == 200:
                    await _read_stream(resp, result, start)
                else:
                    _classify_status(resp, result)
                    result.error = _error_message(await resp.aread()) or f"HTTP {resp.status_code}"
    except TimeoutError:
        if result.status is None or result.status == 200:
            result.outcome = Outcome.LOST
            result.error = f"no end within {config.request_timeout_s:g}s"
        else:  # the status was in; only its body was late
            result.error = result.error or f"HTTP {result.status}"
    except httpx.HTTPError as exc:
        result.outcome = Outcome.ERROR_OTHER
        result.error = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
    return result


def _classify_status(resp: httpx.Response, result: RequestResult) -> None:
    if resp.status_code == 429:
        result.outcome = Outcome.REJECTED_429
        result.retry_after_s = _seconds(resp.headers.get("retry-after"))
    elif resp.status_code >= 500:
        result.outcome = Outcome.ERROR_5XX
    else:
        result.outcome = Outcome.ERROR_OTHER


async def _read_stream(resp: httpx.Response, result: RequestResult, start: float) -> None:
    last_content: float | None = None
    counted_tokens = 0
    usage_tokens: int | None = None
    stream_error: str | None = None
    async for line in resp.aiter_lines():
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        now = time.perf_counter()
        if data == "[DONE]":
            result.saw_done = True
            break
        try:
            event = json.loads(data)
        except ValueError:
            stream_error = f"malformed event {data[:80]!r}"
            continue
        if "error" in event:
            stream_error = (event["error"] or {}).get("message") or "error event"
            continue
        for choice in event.get("choices") or ():
            num_tokens = len((choice.get("logprobs") or {}).get("tokens") or ())
            if choice.get("text") or num_tokens:
                if last_content is None:
                    result.ttft_s = now - start
                else:
                    result.itl_s.append(now - last_content)
                last_content = now
                counted_tokens += num_tokens or 1
            if choice.get("finish_reason"):
                result.finish_reason = choice["finish_reason"]
        if event.get("usage"):
            usage_tokens = event["usage"].get("completion_tokens")
    result.completion_tokens = usage_tokens if usage_tokens is not None else counted_tokens
    if stream_error is not None:
        result.outcome, result.error = Outcome.ERROR_5XX, stream_error
    elif result.saw_done and result.finish_reason not in (None, "abort"):
        result.outcome = Outcome.COMPLETED
    else:
        result.outcome = Outcome.ERROR_OTHER
        result.error = (f"stream ended with finish_reason {result.finish_reason!r}" if result.saw_done
                        else "stream ended without [DONE]")


def _error_message(body: bytes) -> str | None:
    try:
        return json.loads(body)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        return body[:200].decode(errors="replace") or None


def _seconds(value: str | None) -> float | None:
    try:
        return float(value) if value is not None else None
    except ValueError:  # an HTTP date: not what this server sends, and not worth parsing here
        return None


# -- lane targets and the brownout gauge ---------------------------------------------------------------------------


@dataclass(slots=True, frozen=True)
class LaneTargets:
    by_lane: dict[str, LaneTarget]
    # Where they came from: "server" (GET /v1/lanes) or why the config's were used.
    source: str


async def fetch_lane_targets(client: httpx.AsyncClient, config: LoadgenConfig) -> LaneTargets:
    """The server's lane targets, the config's for lanes it does not list; also checks the server answers.

    :raises RtxError: nothing answers at ``config.url``.
    """
    # With keys configured, every route but the probes and /metrics needs one: any tenant's will do.
    headers = {"Authorization": f"Bearer {config.tenants[0].api_key}"} if config.tenants else {}
    try:
        resp = await client.get(config.url + "/v1/lanes", headers=headers, timeout=10)
    except httpx.HTTPError as exc:
        raise RtxError(f"cannot reach the server at {config.url}: {type(exc).__name__} {exc}".rstrip()) from None
    fallback = dict(config.targets)
    if resp.status_code != 200:
        return LaneTargets(fallback, f"config (GET /v1/lanes answered {resp.status_code})")
    try:
        served = {lane["name"]: LaneTarget(float(lane["ttft_target_s"]), float(lane["itl_target_s"]))
                  for lane in resp.json()["lanes"]}
    except (ValueError, KeyError, TypeError, ConfigError) as exc:
        return LaneTargets(fallback, f"config (GET /v1/lanes is not understood: {exc})")
    return LaneTargets({**fallback, **served}, "server")


@dataclass(slots=True, frozen=True)
class BrownoutSample:
    t_s: float
    # None: the gauge was absent or /metrics did not answer.
    level: float | None


_BROWNOUT = re.compile(r"^rtx_brownout_level(?:\{[^}]*\})?\s+(\S+)", re.MULTILINE)


def brownout_level(metrics_text: str) -> float | None:
    """``rtx_brownout_level`` in Prometheus text (the highest, should it carry several label sets)."""
    values = [float(v) for v in _BROWNOUT.findall(metrics_text)]
    return max(values) if values else None


def count_level_changes(samples: list[BrownoutSample]) -> int:
    """Changes between consecutive known levels (samples without a level are skipped)."""
    levels = [s.level for s in samples if s.level is not None]
    return sum(1 for a, b in itertools.pairwise(levels) if a != b)


async def poll_brownout(client: httpx.AsyncClient, config: LoadgenConfig, origin: float,
                        samples: list[BrownoutSample], stop: asyncio.Event) -> None:
    while not stop.is_set():
        tick = time.perf_counter()
        level = None
        try:
            resp = await client.get(config.url + "/metrics", timeout=max(2.0, 4 * config.metrics_interval_s))
            if resp.status_code == 200:
                level = brownout_level(resp.text)
        except httpx.HTTPError:
            pass
        samples.append(BrownoutSample(tick - origin, level))
        remaining = config.metrics_interval_s - (time.perf_counter() - tick)
        try:
            await asyncio.wait_for(stop.wait(), max(remaining, 0.0))
        except TimeoutError:
            pass


# -- capacity ------------------------------------------------------------------------------------------------------


@dataclass(slots=True, frozen=True)
class CapacityResult:
    requests_per_s: float
    num_clients: int
    num_sent: int
    num_completed: int
    # The steady-state window completions were counted in (the measurement minus its first quarter).
    elapsed_s: float

    def to_json(self) -> dict[str, Any]:
        return {"requests_per_s": self.requests_per_s, "num_clients": self.num_clients, "num_sent": self.num_sent,
                "num_completed": self.num_completed, "elapsed_s": self.elapsed_s}


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


# -- the report ----------------------------------------------------------------------------------------------------


def percentile(values: list[float], q: float) -> float | None:
    """The ``q``-th percentile (0-100), linear between the closest ranks (numpy's default); None when empty."""
    if not values:
        return None
    ordered = sorted(values)
    position = (len(ordered) - 1) * q / 100
    below = math.floor(position)
    above = min(below + 1, len(ordered) - 1)
    return ordered[below] + (ordered[above] - ordered[below]) * (position - below)


_QUANTILES = (50, 95, 99)


@dataclass(slots=True, frozen=True)
class LaneStats:
    name: str
    num_sent: int
    # Request counts by outcome; they add up to num_sent.
    num_by_outcome: dict[Outcome, int]
    num_good: int
    # Of requests that completed; ITL pools every gap of every such request.
    ttft_s: dict[int, float | None]
    itl_s: dict[int, float | None]
    num_completion_tokens: int
    # Of the 429s: how many carried a Retry-After in seconds, and its largest value.
    num_retry_after: int
    max_retry_after_s: float | None
    duration_s: float

    @classmethod
    def from_results(cls, name: str, results: list[RequestResult], targets: dict[str, LaneTarget],
                     duration_s: float) -> LaneStats:
        completed = [r for r in results if r.outcome is Outcome.COMPLETED]
        ttfts = [r.ttft_s for r in completed if r.ttft_s is not None]
        itls = [gap for r in completed for gap in r.itl_s]
        retry = [r.retry_after_s for r in results if r.outcome is Outcome.REJECTED_429 and r.retry_after_s is not None]
        counts = Counter(r.outcome for r in results)
        return cls(
            name, len(results), {o: counts.get(o, 0) for o in Outcome},
            sum(1 for r in completed if r.lane in targets and r.is_good(targets[r.lane])),
            {q: percentile(ttfts, q) for q in _QUANTILES}, {q: percentile(itls, q) for q in _QUANTILES},
            sum(r.completion_tokens for r in completed), len(retry), max(retry) if retry else None, duration_s)

    def count(self, outcome: Outcome) -> int:
        return self.num_by_outcome[outcome]

    @property
    def goodput_fraction(self) -> float:
        return self.num_good / self.num_sent if self.num_sent else 0.0

    @property
    def goodput_rate(self) -> float:
        """Good requests per second of the arrival window."""
        return self.num_good / self.duration_s

    def to_json(self) -> dict[str, Any]:
        return {"sent": self.num_sent, **{o.value: n for o, n in self.num_by_outcome.items()},
                "ttft_s": {f"p{q}": _round(v) for q, v in self.ttft_s.items()},
                "itl_s": {f"p{q}": _round(v) for q, v in self.itl_s.items()},
                "good": self.num_good, "goodput_fraction": _round(self.goodput_fraction),
                "goodput_rps": _round(self.goodput_rate), "completion_tokens": self.num_completion_tokens,
                "retry_after": {"num_with_header": self.num_retry_after, "max_s": self.max_retry_after_s}}


@dataclass(slots=True)
class LoadgenReport:
    url: str
    pattern: ArrivalPattern
    # Base rate offered (requests/s); a spiky pattern multiplies it inside spikes.
    offered_rate: float
    # The multiple of capacity asked for; None when an absolute rate was.
    load: float | None
    duration_s: float
    seed: int
    # Requests/s: measured, or as given (then ``capacity_measurement`` is None); None with an absolute rate.
    capacity: float | None
    capacity_measurement: CapacityResult | None
    targets: LaneTargets
    lanes: list[LaneStats]
    overall: LaneStats
    brownout: list[BrownoutSample]
    # How late the client sent its requests after their planned times: a busy client machine shows here.
    max_send_lag_s: float
    results: list[RequestResult]

    @property
    def brownout_changes(self) -> int:
        return count_level_changes(self.brownout)

    def to_json(self) -> dict[str, Any]:
        levels = sorted({s.level for s in self.brownout if s.level is not None})
        return {
            "url": self.url, "pattern": self.pattern.to_json(), "offered_rate_rps": self.offered_rate,
            "load": self.load, "duration_s": self.duration_s, "seed": self.seed, "capacity_rps": self.capacity,
            "capacity_measurement": self.capacity_measurement.to_json() if self.capacity_measurement else None,
            "targets": {"source": self.targets.source,
                        "lanes": {k: {"ttft_s": t.ttft_s, "itl_s": t.itl_s} for k, t in self.targets.by_lane.items()}},
            "lanes": {s.name: s.to_json() for s in self.lanes},
            "overall": self.overall.to_json(),
            "brownout": {"samples": [[_round(s.t_s), s.level] for s in self.brownout], "levels_seen": levels,
                         "num_changes": self.brownout_changes},
            "max_send_lag_s": _round(self.max_send_lag_s),
            "error_messages": dict(Counter(r.error for r in self.results if r.error).most_common(10)),
            "requests": [r.to_json() for r in self.results],
        }

    def table(self) -> str:
        """The summary as aligned text: one row per lane and one for all."""
        if self.capacity is None:
            rate = f"{self.offered_rate:.3g} req/s"
        else:
            measured = "measured" if self.capacity_measurement else "given"
            rate = f"{self.offered_rate:.3g} req/s = {self.load:g}x capacity {self.capacity:.3g} req/s ({measured})"
        lines = [f"# {self.url}: {self.pattern.describe()} at {rate} for {self.duration_s:g}s, seed {self.seed}"]
        header = (f"{'lane':10} {'sent':>5} {'done':>5} {'429':>5} {'5xx':>4} {'other':>5} {'lost':>4}  "
                  f"{'ttft p50':>8} {'p95':>6} {'p99':>6}  {'itl p50':>7} {'p95':>6} {'p99':>6}  "
                  f"{'good':>5} {'good%':>6} {'good/s':>6}")
        lines.append(header)
        for s in [*self.lanes, self.overall]:
            lines.append(
                f"{s.name:10} {s.num_sent:5} {s.count(Outcome.COMPLETED):5} {s.count(Outcome.REJECTED_429):5} "
                f"{s.count(Outcome.ERROR_5XX):4} {s.count(Outcome.ERROR_OTHER):5} {s.count(Outcome.LOST):4}  "
                f"{_s(s.ttft_s[50]):>8} {_s(s.ttft_s[95]):>6} {_s(s.ttft_s[99]):>6}  "
                f"{_s(s.itl_s[50]):>7} {_s(s.itl_s[95]):>6} {_s(s.itl_s[99]):>6}  "
                f"{s.num_good:5} {100 * s.goodput_fraction:5.1f}% {s.goodput_rate:6.2f}")
        lines.append("times in seconds; goodput: completed within the lane's TTFT target and p95 ITL target")
        if self.overall.count(Outcome.COMPLETED) and self.overall.ttft_s[50] is None:
            lines.append("no completed request streamed text to time: a model without a tokenizer needs logprobs "
                         "(--logprobs)")
        lines.append("targets from " + self.targets.source + ": " + ", ".join(
            f"{k} ttft<={t.ttft_s:g}s itl<={t.itl_s:g}s" for k, t in self.targets.by_lane.items()
            if any(s.name == k for s in self.lanes)))
        levels = [s.level for s in self.brownout if s.level is not None]
        if levels:
            lines.append(f"brownout level: {len(self.brownout)} samples, max {max(levels):g}, "
                         f"{self.brownout_changes} changes")
        else:
            lines.append(f"brownout level: absent from /metrics ({len(self.brownout)} polls)")
        lines.append(f"client send lag: max {self.max_send_lag_s * 1000:.0f} ms")
        return "\n".join(lines)


def _s(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 6)


# -- the run -------------------------------------------------------------------------------------------------------


def make_client(config: LoadgenConfig) -> httpx.AsyncClient:
    # No httpx timeout: each request's whole exchange is bounded by request_timeout_s instead. trust_env=False: a
    # proxy from the environment would sit between the load and the server it measures.
    limits = httpx.Limits(max_connections=config.max_connections, max_keepalive_connections=config.max_connections)
    return httpx.AsyncClient(timeout=None, limits=limits, trust_env=False)


async def run_loadgen(config: LoadgenConfig, log: Callable[[str], None] | None = None) -> LoadgenReport:
    """Measure capacity if needed, then offer the load; ``log`` receives a line as each phase starts and ends.

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
        if config.rate is None and capacity is None:
            say(f"measuring capacity: {config.capacity_clients} closed-loop clients for "
                f"{config.capacity_duration_s:g}s...")
            measurement = await _measure_capacity(client, config)
            capacity = measurement.requests_per_s
            say(f"capacity {capacity:.3g} req/s ({measurement.num_completed} completed in "
                f"{measurement.elapsed_s:.1f}s)")
        base_rate = config.rate if config.rate is not None else config.load * capacity
        plan = plan_requests(config, base_rate)
        say(f"offering {base_rate:.3g} req/s, {config.pattern.describe()}, for {config.duration_s:g}s: "
            f"{len(plan)} requests")
        results, samples, max_lag = await _open_loop(client, config, plan)
    lanes = [LaneStats.from_results(lane.name, [r for r in results if r.lane == lane.name], targets.by_lane,
                                    config.duration_s) for lane in config.lanes]
    overall = LaneStats.from_results("all", results, targets.by_lane, config.duration_s)
    return LoadgenReport(config.url, config.pattern, base_rate, config.load if config.rate is None else None,
                         config.duration_s, config.seed, capacity if config.rate is None else None, measurement,
                         targets, lanes, overall, samples, max_lag, results)


async def _open_loop(client: httpx.AsyncClient, config: LoadgenConfig, plan: list[PlannedRequest]
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
    try:
        for planned in plan:
            prompt = random_prompt(planned.num_prompt_tokens, config.token_id_range, prompt_rng)
            delay = origin + planned.send_at_s - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            now = time.perf_counter() - origin
            max_lag = max(max_lag, now - planned.send_at_s)
            tasks.append(asyncio.ensure_future(send_request(client, config, planned, prompt, now)))
        results = list(await asyncio.gather(*tasks))
    finally:
        for task in tasks:  # only when interrupted: gather has finished them otherwise
            task.cancel()
        stop.set()
        await poller
    return results, samples, max_lag


def run_loadgen_sync(config: LoadgenConfig, log: Callable[[str], None] | None = None) -> LoadgenReport:
    return asyncio.run(run_loadgen(config, log))
