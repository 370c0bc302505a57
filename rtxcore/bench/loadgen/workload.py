"""What a load run sends and when: lane profiles, tenants, arrival patterns, the plan of requests, and the
run's configuration."""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field
from typing import Any

import httpx

from rtxcore.errors import ConfigError

LANE_HEADER = "x-rtx-lane"
# The longest prompt or output a lane may ask for: the longest context windows served today are about a million
# tokens. Without a bound, a typo (99999999) built a prompt of that many ids, in memory, for every request.
MAX_LENGTH_TOKENS = 1 << 20
# Requests one load phase may plan: every arrival is planned before the first is sent (candidates drawn at the peak
# rate), and every result is kept for the report, token times included. A million is hours of load at a hundred
# requests a second, and a few GB of memory; a --rate or --duration typo grew the plan until memory ran out.
MAX_PLANNED_REQUESTS = 1_000_000
# Connections of the client's pool: open loop, enough that a request is never held back waiting for one. Also the
# most closed-loop clients measuring capacity: more would wait for a connection, not run side by side.
MAX_CONNECTIONS = 4096


# -- what is sent --------------------------------------------------------------------------------------------------


@dataclass(slots=True, frozen=True)
class LengthRange:
    """Token counts drawn uniformly from ``[low, high]``, both ends included."""

    low: int
    high: int

    def __post_init__(self) -> None:
        if not 1 <= self.low <= self.high <= MAX_LENGTH_TOKENS:
            raise ConfigError(f"a length range needs 1 <= low <= high, high at most {MAX_LENGTH_TOKENS:,}, got "
                              f"{self.low}:{self.high}")

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


# Sized for the CPU default model on 2 cores (docs/workloads.md): short realtime requests, long bulk.
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


def check_plan_size(config: LoadgenConfig, base_rate: float, given: str | None = None) -> None:
    """Refuse a load phase at ``base_rate`` that would draw more than :data:`MAX_PLANNED_REQUESTS` arrivals
    (candidates come at the pattern's peak rate).

    :param given: how the command line gave the rate (``--rate 5``), to name it and --duration; else the rate alone.
    :raises ConfigError: the rate, the duration and about how many requests they make.
    """
    peak = config.pattern.peak_factor
    expected = base_rate * peak * config.duration_s
    if expected > MAX_PLANNED_REQUESTS:
        rate = f"{given or f'{base_rate:g}'} requests/s{f' (x{peak:g} in spikes)' if peak > 1 else ''}"
        duration = f"{'--duration ' if given else ''}{config.duration_s:g} s"
        raise ConfigError(f"{rate} for {duration} is about {expected:,.0f} requests; at most "
                          f"{MAX_PLANNED_REQUESTS:,}: lower the load or the duration")


def plan_requests(config: LoadgenConfig, base_rate: float) -> list[PlannedRequest]:
    """The load phase's requests; the same seed gives the same plan.

    :raises ConfigError: more than :data:`MAX_PLANNED_REQUESTS` would be drawn.
    """
    check_plan_size(config, base_rate)
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
    max_connections: int = MAX_CONNECTIONS

    def __post_init__(self) -> None:
        if not self.url.startswith(("http://", "https://")):
            raise ConfigError(f"url must start with http:// or https://, got {self.url!r}")
        try:
            # httpx parses it as it will connect: a port past 65535 would only fail there, deep in a task group.
            url = httpx.URL(self.url)
            ok = bool(url.host) and (url.port is None or 0 < url.port <= 65535)
        except (httpx.InvalidURL, ValueError):
            ok = False
        if not ok:
            raise ConfigError(f"url must be http(s)://HOST[:PORT] with a port in [1, 65535], got {self.url!r}")
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
