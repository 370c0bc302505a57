"""OpenAI batch files run offline (``rtx run-batch``, as vLLM's ``run-batch``): each line of the input asks for one
chat completion, completion or embedding; each line of the output answers one, matched by its ``custom_id``.

Input line (OpenAI's Batch API format)::

    {"custom_id": "q1", "method": "POST", "url": "/v1/chat/completions", "body": {"messages": [...]}}

Output line, written as each request ends (so in the order they end, as OpenAI's are)::

    {"id": "batch_req_...", "custom_id": "q1", "response": {"status_code": 200, "request_id": "...",
     "body": {...}}, "error": null}

A request the server refuses keeps its status and error body in ``response``, as OpenAI reports them. Each request
goes through the served HTTP app in this process (no socket), so a batch line is parsed, checked and answered
exactly as the same body sent to ``rtx serve``.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

import httpx

from rtxcore.errors import ConfigError
from rtxcore.server.serving.runtime import ServingRuntime

# The routes a batch line may name.
BATCH_URLS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings")


@dataclass(frozen=True, slots=True)
class BatchLine:
    custom_id: str
    url: str
    body: dict[str, Any]


@dataclass(slots=True)
class BatchSummary:
    # Requests answered, by HTTP status.
    statuses: Counter[int] = field(default_factory=Counter)

    @property
    def num_requests(self) -> int:
        return sum(self.statuses.values())

    @property
    def num_failed(self) -> int:
        return sum(n for status, n in self.statuses.items() if status != 200)


def read_batch_file(path: Path) -> list[BatchLine]:
    """Every request of a batch file, checked before any is run.

    :raises ConfigError: the file cannot be read, or a line is not a batch request (naming the line).
    """
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"cannot read batch file {str(path)!r}: {getattr(exc, 'strerror', None) or exc}") from None
    lines: list[BatchLine] = []
    seen: set[str] = set()
    for number, raw in enumerate(text.splitlines(), 1):
        if not raw.strip():
            continue
        line = _parse_line(raw, f"{path}, line {number}")
        if line.custom_id in seen:
            raise ConfigError(f"{path}, line {number}: custom_id {line.custom_id!r} is used twice: each request "
                              "needs its own, to find its answer")
        seen.add(line.custom_id)
        lines.append(line)
    if not lines:
        raise ConfigError(f"batch file {str(path)!r} holds no requests")
    return lines


def _parse_line(raw: str, where: str) -> BatchLine:
    try:
        item = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{where}: not JSON ({exc.msg}, column {exc.colno})") from None
    if not isinstance(item, dict):
        raise ConfigError(f"{where}: expected an object with custom_id, method, url and body")
    custom_id, method, url, body = (item.get(k) for k in ("custom_id", "method", "url", "body"))
    if not isinstance(custom_id, str) or not custom_id:
        raise ConfigError(f"{where}: custom_id must be a non-empty string")
    if method != "POST":
        raise ConfigError(f"{where}: method must be \"POST\", got {method!r}")
    if url not in BATCH_URLS:
        raise ConfigError(f"{where}: url must be one of {', '.join(BATCH_URLS)}, got {url!r}")
    if not isinstance(body, dict):
        raise ConfigError(f"{where}: body must be an object (the request's JSON body)")
    if body.get("stream"):
        raise ConfigError(f"{where}: stream cannot be true in a batch: each answer is written whole")
    return BatchLine(custom_id, url, body)


async def run_batch(runtime: ServingRuntime, lines: list[BatchLine], out: TextIO, concurrency: int,
                    progress: Callable[[int, int], None] | None = None) -> BatchSummary:
    """Send every line to the app of a loaded ``runtime``, at most ``concurrency`` at once, writing each answer to
    ``out`` as it comes."""
    from rtxcore.server.http import build_app

    summary = BatchSummary()
    pending: Iterator[BatchLine] = iter(lines)
    if progress is not None:
        progress(0, len(lines))
    transport = httpx.ASGITransport(app=build_app(runtime))
    async with httpx.AsyncClient(transport=transport, base_url="http://rtx-batch", timeout=None) as client:

        async def worker() -> None:
            # Workers share one iterator: at most `concurrency` requests in flight, however long the file.
            for line in pending:
                response = await client.post(line.url, json=line.body)
                out.write(json.dumps(_answer(line, response), ensure_ascii=False) + "\n")
                out.flush()
                summary.statuses[response.status_code] += 1
                if progress is not None:
                    progress(summary.num_requests, len(lines))

        await asyncio.gather(*(worker() for _ in range(min(concurrency, len(lines)))))
    return summary


def _answer(line: BatchLine, response: httpx.Response) -> dict[str, Any]:
    try:
        body = response.json()
    except ValueError:  # every route answers JSON; a middleware's plain error would not
        body = {"error": {"message": response.text}}
    return {"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": line.custom_id,
            "response": {"status_code": response.status_code, "request_id": response.headers.get("x-request-id"),
                         "body": body},
            "error": None}
