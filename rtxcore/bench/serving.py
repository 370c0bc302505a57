"""Served throughput: concurrent streaming clients against ``rtx serve``, compared with the offline engine.

The server runs in a subprocess on 127.0.0.1 (a free port) with the same engine options, so the figure includes
HTTP, SSE and the asyncio driver, and nothing else competes with it while it is measured.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from rtxcore.bench.workloads import BenchRequest
from rtxcore.capacity.step_time import nearest_rank
from rtxcore.errors import RtxError


@dataclass(slots=True)
class ServedResult:
    label: str
    num_requests: int
    output_tokens: int
    elapsed_s: float
    ttft_s: list[float]
    errors: int

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.elapsed_s

    def ttft_percentile(self, q: float) -> float:
        return nearest_rank(self.ttft_s, q)

    @property
    def ms_per_token_per_request(self) -> float:
        return 1000 * self.elapsed_s * self.num_requests / max(self.output_tokens, 1)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(engine_args: list[str], timeout: float = 300.0) -> tuple[subprocess.Popen, str]:
    port = _free_port()
    rtx = str(Path(sys.executable).with_name("rtx"))
    proc = subprocess.Popen([rtx, "serve", "--port", str(port), "--no-grpc", *engine_args],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=os.environ.copy())
    base = f"http://127.0.0.1:{port}"
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RtxError(f"rtx serve exited with code {proc.returncode} before it was ready")
        try:
            if httpx.get(base + "/ready", timeout=2).status_code == 200:
                return proc, base
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise RtxError("rtx serve did not become ready in time")


def stop_server(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()


async def _one(client, base: str, model: str, r: BenchRequest, ttfts: list[float]) -> int:
    body = {"model": model, "prompt": r.prompt_token_ids, "max_tokens": r.output_len, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    first = None
    tokens = 0
    async with client.stream("POST", base + "/v1/completions", json=body) as resp:
        if resp.status_code != 200:
            raise RtxError(f"HTTP {resp.status_code}: {(await resp.aread())[:200]!r}")
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if first is None and event.get("choices") and event["choices"][0].get("text"):
                first = time.perf_counter()
            if event.get("usage"):
                tokens = event["usage"]["completion_tokens"]
    ttfts.append((first or time.perf_counter()) - start)
    return tokens


async def _run_clients(base: str, requests: list[BenchRequest],
                       progress: Callable[[int, int], None] | None = None) -> ServedResult:
    import httpx

    ttfts: list[float] = []
    limits = httpx.Limits(max_connections=len(requests) + 4)
    async with httpx.AsyncClient(timeout=None, limits=limits) as client:
        model = (await client.get(base + "/v1/models")).json()["data"][0]["id"]
        clients = [asyncio.ensure_future(_one(client, base, model, r, ttfts)) for r in requests]
        if progress is not None:
            _report_ended(clients, progress)
        start = time.perf_counter()
        results = await asyncio.gather(*clients, return_exceptions=True)
        elapsed = time.perf_counter() - start
    errors = sum(1 for x in results if isinstance(x, BaseException))
    produced = sum(x for x in results if isinstance(x, int))
    return ServedResult(f"rtx serve ({len(requests)} streaming clients)", len(requests), produced, elapsed, ttfts,
                        errors)


def _report_ended(clients: Sequence[asyncio.Future], progress: Callable[[int, int], None]) -> None:
    progress(0, len(clients))
    ended = 0

    def one_ended(_: asyncio.Future) -> None:
        nonlocal ended
        ended += 1
        progress(ended, len(clients))
    for future in clients:
        future.add_done_callback(one_ended)


def run_served(engine_args: list[str], requests: list[BenchRequest],
               progress: Callable[[int, int], None] | None = None) -> ServedResult:
    """:param progress: called as ``progress(num_ended, num_requests)``: with 0 as the clients start, then as each
        client's request ends."""
    proc, base = start_server(engine_args)
    try:
        # Warm-up request, as the offline run gets one.
        asyncio.run(_run_clients(base, requests[:1]))
        return asyncio.run(_run_clients(base, requests, progress))
    finally:
        stop_server(proc)


def summarize(result: ServedResult) -> str:
    ttft = result.ttft_s
    mean = statistics.fmean(ttft) if ttft else float("nan")
    return (f"TTFT p50 {result.ttft_percentile(0.5):.2f}s p99 {result.ttft_percentile(0.99):.2f}s "
            f"(mean {mean:.2f}s); errors {result.errors}")
