"""The fleet view: what the Helm chart's HorizontalPodAutoscaler sees, worked out inside one pod for its dashboard.

The chart scales on two per-pod metrics, each averaged over the pods against a target (``AverageValue``): the queue
depth (``rtx_num_requests_waiting``) and the p95 time to first token over the last two minutes (prometheus-adapter's
``histogram_quantile(0.95, rate(...[2m]))``). A pod alone cannot ask the HPA what it decided, but it can read its peers'
``/metrics`` (the chart's headless Service resolves to every ready pod) and apply the HPA's own rule: each metric
proposes ``ceil(replicas * average / target)`` unless the ratio is within the 10% tolerance (pods without the metric
counted as Kubernetes' replica calculator counts them), the largest proposal wins, no scale-in while a metric is
unavailable, clamped to the replica bounds. The view is that recommendation before the HPA's stabilization windows
and scaling policies. In the chart's KEDA mode the latency trigger is one p95 over the whole service (the pods'
buckets summed) compared as a ``Value``, which is what ``mode="keda"`` computes instead of the average of the pods'
p95s.

Scrapes run on the server's event loop with an async HTTP client, never on the engine's thread.
"""

from __future__ import annotations

import asyncio
import logging
import math
import socket
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from rtxcore.errors import ConfigError

log = logging.getLogger("rtx.fleet")

QUEUE_METRIC = "rtx_num_requests_waiting"
TTFT_METRIC = "rtx_time_to_first_token_seconds"
LANE_TTFT_METRIC = "rtx_lane_time_to_first_token_seconds"
# The HPA leaves the replica count alone while a metric's ratio to its target is within this (its default).
HPA_TOLERANCE = 0.1
# Cumulative bucket counts by upper bound (math.inf for +Inf).
Buckets = dict[float, float]
# The chart's autoscaling.mode: how the latency signal is formed (see the module's docstring).
MODES = ("hpa", "keda")


@dataclass(frozen=True, slots=True)
class FleetSettings:
    # "host" or "host:port" (IPv6 as "[addr]:port"); a host without a port is reached on this server's HTTP port,
    # and a name may resolve to many addresses (one per ready pod of a headless Service).
    peers: tuple[str, ...]
    target_queue_depth: float | None = None
    target_ttft_p95_s: float | None = None
    min_replicas: int = 1
    max_replicas: int | None = None
    # The p95 of this lane's histogram (the chart's autoscaling.latencyLane); None: all lanes.
    latency_lane: str | None = None
    interval_s: float = 10.0
    # prometheus-adapter's rate window for the p95.
    window_s: float = 120.0
    mode: str = "hpa"

    def __post_init__(self) -> None:
        if not self.peers:
            raise ConfigError("--fleet-peers needs at least one host")
        for peer in self.peers:
            parse_peer(peer, 1)
        for name, value in (("--autoscale-queue-depth", self.target_queue_depth),
                            ("--autoscale-ttft-p95", self.target_ttft_p95_s)):
            if value is not None and not (math.isfinite(value) and value > 0):
                raise ConfigError(f"{name} must be a positive number, got {value}")
        if self.min_replicas < 1 or (self.max_replicas is not None and self.max_replicas < self.min_replicas):
            raise ConfigError(f"--autoscale-replicas needs 1 <= MIN <= MAX, got {self.min_replicas}:"
                              f"{self.max_replicas}")
        if not (math.isfinite(self.interval_s) and self.interval_s > 0):
            raise ConfigError(f"--fleet-interval must be a positive number of seconds, got {self.interval_s}")
        if self.mode not in MODES:
            raise ConfigError(f"--autoscale-mode must be one of {', '.join(MODES)}, got {self.mode!r}")


def parse_peer(text: str, default_port: int) -> tuple[str, int]:
    """``host``, ``host:port`` or ``[v6]:port`` -> (host, port). :raises ConfigError: naming the entry."""
    host, port = text.strip(), str(default_port)
    if host.startswith("["):
        end = host.find("]")
        if end < 0 or (host[end + 1:] and not host[end + 1:].startswith(":")):
            raise ConfigError(f"--fleet-peers entry {text!r}: expected [address]:port")
        host, port = host[1:end], host[end + 2:] or port
    elif host.count(":") == 1:
        host, port = host.split(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(f"--fleet-peers entry {text!r}: expected host or host:port with a port in 1-65535")
    return host, int(port)


def parse_autoscale_replicas(text: str) -> tuple[int, int | None]:
    """``MIN:MAX`` or ``MIN`` -> (min, max or None). :raises ConfigError: not that form."""
    low, _, high = text.partition(":")
    if not low.isdigit() or (high and not high.isdigit()):
        raise ConfigError(f"--autoscale-replicas expects MIN:MAX (e.g. 2:8), got {text!r}")
    return int(low), int(high) if high else None


def histogram_quantile(q: float, buckets: Buckets) -> float | None:
    """Prometheus's ``histogram_quantile`` on cumulative bucket counts: linear within the bucket holding the q-th
    observation, the highest finite bound for the +Inf bucket, None (Prometheus: NaN) with no observations. Written
    here because no Python library computes it from bucket counts; the dashboard's JavaScript does the same."""
    bounds = sorted(buckets)
    if not bounds or buckets[bounds[-1]] <= 0:
        return None
    rank = q * buckets[bounds[-1]]
    lower, below = 0.0, 0.0
    for le in bounds:
        cum = buckets[le]
        if cum >= rank:
            if math.isinf(le):
                return lower
            return lower + (le - lower) * (rank - below) / max(cum - below, 1e-12)
        lower, below = le, cum
    return lower


def hpa_proposal(current: int, values: Sequence[float], num_missing: int, target: float) -> int | None:
    """The replica count the HPA asks for on one per-pod ``AverageValue`` metric, as Kubernetes' replica calculator
    works it out: ``current`` replicas, ``values`` of the pods that have the metric and ``num_missing`` that do not.
    Missing pods count as 0 when the others ask to scale up and as the target when they ask to scale down; a
    direction that this reverses, or a ratio within the tolerance, keeps ``current``. None when no pod has it (the
    metric is unavailable)."""
    if not values:
        return None
    ratio = sum(values) / len(values) / target
    if not num_missing:
        return current if abs(ratio - 1.0) <= HPA_TOLERANCE else math.ceil(ratio * len(values))
    filled = 0.0 if ratio > 1.0 else target
    new_ratio = (sum(values) + filled * num_missing) / (len(values) + num_missing) / target
    if abs(new_ratio - 1.0) <= HPA_TOLERANCE or (ratio < 1.0 < new_ratio) or (new_ratio < 1.0 < ratio):
        return current
    proposal = math.ceil(new_ratio * (len(values) + num_missing))
    if (new_ratio < 1.0 and proposal > current) or (new_ratio > 1.0 and proposal < current):
        return current
    return proposal


def value_proposal(current: int, value: float | None, target: float) -> int | None:
    """The same for a ``Value`` metric (one figure for the whole service: the chart's KEDA latency trigger)."""
    if value is None:
        return None
    ratio = value / target
    return current if abs(ratio - 1.0) <= HPA_TOLERANCE else math.ceil(ratio * current)


@dataclass(slots=True)
class PodSample:
    queue_depth: float | None
    ttft_buckets: Buckets


def read_sample(text: str, lane: str | None) -> PodSample:
    """The two autoscaling signals' raw figures from one pod's ``/metrics`` text."""
    queue: float | None = None
    buckets: Buckets = {}
    histogram = LANE_TTFT_METRIC if lane else TTFT_METRIC
    for family in text_string_to_metric_families(text):
        if family.name == QUEUE_METRIC:
            queue = sum(s.value for s in family.samples)
        elif family.name == histogram:
            for s in family.samples:
                if s.name.endswith("_bucket") and (lane is None or s.labels.get("lane") == lane):
                    le = float(s.labels["le"])
                    buckets[le] = buckets.get(le, 0.0) + s.value
    return PodSample(queue, buckets)


def _went_down(before: Buckets, after: Buckets) -> bool:
    return any(after.get(le, 0.0) < count for le, count in before.items())


class FleetWatcher:
    """Scrapes the peers every ``interval_s`` and keeps the latest :meth:`view`."""

    def __init__(self, settings: FleetSettings, tls_client_cert: tuple[str, str] | None = None):
        self.settings = settings
        self._scheme = "https" if tls_client_cert else "http"
        self._cert = tls_client_cert
        # Per address: (monotonic time, TTFT buckets) of the scrapes within the window, oldest first.
        self._history: dict[str, deque[tuple[float, Buckets]]] = {}
        self._view: dict[str, Any] = {"configured": True, "updated_at": None, "pods": []}

    def view(self) -> dict[str, Any]:
        return self._view

    async def run(self, own_port: int) -> None:
        # httpx logs every request at INFO: a scrape per peer every few seconds would fill the server's log.
        logging.getLogger("httpx").setLevel(logging.WARNING)
        # Pods are addressed by IP, which their serving certificate does not name: the scrape does not verify it
        # (/metrics holds no secret); under mutual TLS it presents this server's own certificate.
        try:
            client = httpx.AsyncClient(timeout=min(5.0, self.settings.interval_s), verify=False, cert=self._cert)
        except Exception:  # e.g. an unreadable certificate: said now, not when the server stops
            log.exception("the fleet view cannot start")
            raise
        async with client:
            while True:
                try:
                    await self.scrape_once(client, own_port)
                except Exception:  # a bad scrape must not end the loop (nor the server)
                    log.exception("fleet scrape failed")
                await asyncio.sleep(self.settings.interval_s)

    async def scrape_once(self, client: httpx.AsyncClient, own_port: int) -> None:
        # The view is dated when its scrapes begin: everything a pod counted before then is in it (dated when they
        # end, a round begun before a burst finished could pass for one read after it).
        started = time.time()
        addresses = await self._resolve(own_port)
        results = await asyncio.gather(*(self._scrape(client, a) for a in addresses))
        now = time.monotonic()
        pods = []
        fleet_increase: list[Buckets] = []
        for address, (sample, error) in zip(addresses, results):
            pod: dict[str, Any] = {"address": address, "up": sample is not None, "error": error,
                                   "queue_depth": None, "ttft_p95_s": None}
            if sample is not None:
                history = self._history.setdefault(address, deque())
                if history and _went_down(history[-1][1], sample.ttft_buckets):
                    history.clear()  # the pod restarted (its counters began again): nothing before it counts
                history.append((now, sample.ttft_buckets))
                # Like rate() over the window: the increase over the scrapes within it, two at least.
                while len(history) > 2 and now - history[0][0] > self.settings.window_s:
                    history.popleft()
                increase = self._increase(history)
                fleet_increase.append(increase)
                pod["queue_depth"] = sample.queue_depth
                pod["ttft_p95_s"] = histogram_quantile(0.95, increase)
            pods.append(pod)
        for gone in set(self._history) - set(addresses):
            del self._history[gone]
        summed: Buckets = {}
        for increase in fleet_increase:
            for le, count in increase.items():
                summed[le] = summed.get(le, 0.0) + count
        self._view = self._summarise(pods, histogram_quantile(0.95, summed), started)

    @staticmethod
    def _increase(history: deque[tuple[float, Buckets]]) -> Buckets:
        if len(history) < 2:
            return {}
        (_, first), (_, last) = history[0], history[-1]
        return {le: count - first.get(le, 0.0) for le, count in last.items()}

    def _summarise(self, pods: list[dict[str, Any]], fleet_p95: float | None, updated_at: float) -> dict[str, Any]:
        s = self.settings
        up = [p for p in pods if p["up"]]
        # The HPA's current replicas are the pods it scales, answering or not (their metrics are then missing).
        current = len(pods)
        signals = []
        for name, metric, key, target in (
                ("queue depth", QUEUE_METRIC, "queue_depth", s.target_queue_depth),
                ("TTFT p95", LANE_TTFT_METRIC if s.latency_lane else TTFT_METRIC, "ttft_p95_s", s.target_ttft_p95_s)):
            # A pod with no value (no first token in the window, or not answering) has the metric missing.
            values = [p[key] for p in up if p[key] is not None]
            average = sum(values) / len(values) if values else None
            proposal = None
            if s.mode == "keda" and key == "ttft_p95_s":
                average = fleet_p95
                if target is not None and current:
                    proposal = value_proposal(current, average, target)
            elif s.mode == "keda":
                # KEDA's query sums the pods' queues (a pod without one adds nothing) and the HPA divides by the
                # target: an external AverageValue metric.
                if target is not None and current and values:
                    proposal = value_proposal(current, sum(values) / current, target)
            elif target is not None and current:
                proposal = hpa_proposal(current, values, current - len(values), target)
            signals.append({"name": name, "metric": metric, "average": average, "target": target,
                            "ratio": average / target if average is not None and target else None,
                            "proposal": proposal})
        proposals = [sig["proposal"] for sig in signals if sig["proposal"] is not None]
        desired = max(proposals) if proposals else current
        # The HPA does not scale in while a metric it was given cannot be computed.
        if any(sig["target"] is not None and sig["proposal"] is None for sig in signals):
            desired = max(desired, current)
        desired = max(desired, s.min_replicas)
        if s.max_replicas is not None:
            desired = min(desired, s.max_replicas)
        return {"configured": True, "updated_at": updated_at, "interval_s": s.interval_s, "window_s": s.window_s,
                "peers": list(s.peers), "mode": s.mode, "latency_lane": s.latency_lane, "pods": pods,
                "current_replicas": current, "replicas": len(up), "unreachable": current - len(up),
                "signals": signals, "min_replicas": s.min_replicas, "max_replicas": s.max_replicas,
                "desired_replicas": desired}

    async def _resolve(self, own_port: int) -> list[str]:
        loop = asyncio.get_running_loop()
        addresses: list[str] = []
        for peer in self.settings.peers:
            host, port = parse_peer(peer, own_port)
            try:
                infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
            except OSError as exc:
                log.warning("fleet peer %s does not resolve: %s", host, exc)
                continue
            # A dual-stack name gives each pod twice (IPv4 and IPv6): one family, IPv4 where there is one.
            v4 = [info for info in infos if info[0] == socket.AF_INET]
            for info in v4 or infos:
                ip = str(info[4][0])
                address = f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}"
                if address not in addresses:
                    addresses.append(address)
        return sorted(addresses)

    async def _scrape(self, client: httpx.AsyncClient, address: str) -> tuple[PodSample | None, str | None]:
        try:
            response = await client.get(f"{self._scheme}://{address}/metrics")
            response.raise_for_status()
            return read_sample(response.text, self.settings.latency_lane), None
        except (httpx.HTTPError, ValueError) as exc:
            return None, f"{type(exc).__name__}: {exc}"
