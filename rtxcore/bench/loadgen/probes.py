"""What the load generator reads from the server besides answers: lane targets and the brownout gauge."""

from __future__ import annotations

import asyncio
import itertools
import re
import time
from dataclasses import dataclass

import httpx

from rtxcore.bench.loadgen.workload import LaneTarget, LoadgenConfig
from rtxcore.errors import ConfigError, RtxError


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
        # Connecting says whether anything answers; the answer itself may wait behind a busy or stalled engine
        # (the route asks the engine thread), which is load to measure, not an unreachable server.
        resp = await client.get(config.url + "/v1/lanes", headers=headers,
                                timeout=httpx.Timeout(config.request_timeout_s, connect=10))
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
