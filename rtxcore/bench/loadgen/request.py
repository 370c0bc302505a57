"""One streamed request and what it got: its outcome, time to first token and inter-token gaps."""

from __future__ import annotations

import asyncio
import enum
import json
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

from rtxcore.bench.loadgen.stats import percentile, rounded
from rtxcore.bench.loadgen.workload import LANE_HEADER, LaneTarget, LoadgenConfig, PlannedRequest


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
        return {"lane": self.lane, "tenant": self.tenant, "sent_at_s": rounded(self.sent_at_s),
                "outcome": self.outcome.value, "status": self.status, "ttft_s": rounded(self.ttft_s),
                "itl_p95_s": rounded(self.itl_p95_s), "max_tokens": self.max_tokens,
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
