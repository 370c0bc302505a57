"""Clients of the HTTP API (OpenAI-compatible routes and the native ``/generate``), sync and async, over httpx.

Streaming methods return generators of event dicts. Leaving one early (``break`` then ``close()``, a ``with
contextlib.closing(...)`` block, or cancelling the task that iterates an async one) closes the HTTP stream, and the
server aborts the request. Every call is retried by :class:`RetryPolicy` on 429/503, honouring ``Retry-After``.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncGenerator, Generator, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import httpx

from rtxcore.client.errors import APIConnectionError, APIError, APITimeoutError
from rtxcore.client.retry import RetryPolicy, parse_retry_after

DEFAULT_BASE_URL = "http://127.0.0.1:8000"
DEFAULT_TIMEOUT_S = 60.0
Prompt = str | Sequence[int]
Messages = Sequence[dict[str, Any]]
# A stream of events as dicts: generators, so a caller that stops early can close them (and the response).
Events = Generator[dict]
AsyncEvents = AsyncGenerator[dict]


class _Done:
    """Marks the end of an SSE stream (``data: [DONE]``)."""


_DONE = _Done()


class Client:
    """Sync client. ``timeout`` (seconds, or an ``httpx.Timeout``) bounds connecting and each read; streams may run
    longer as long as events keep coming."""

    def __init__(self, base_url: str = DEFAULT_BASE_URL, *, timeout: float | httpx.Timeout = DEFAULT_TIMEOUT_S,
                 retry: RetryPolicy | None = None, api_key: str | None = None,
                 transport: httpx.BaseTransport | None = None):
        self.retry = retry or RetryPolicy()
        self._http = httpx.Client(base_url=base_url, timeout=timeout, headers=_headers(api_key), transport=transport)

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def close(self) -> None:
        self._http.close()

    # -- OpenAI-compatible routes ---------------------------------------------------------------------------------

    def completions(self, prompt: Prompt, *, model: str | None = None, **params: Any) -> dict:
        return self._post("/v1/completions", _body(model, params, prompt=_prompt(prompt)))

    def stream_completions(self, prompt: Prompt, *, model: str | None = None, **params: Any) -> Events:
        """OpenAI completion chunks as dicts; the text of each is ``chunk["choices"][0]["text"]``."""
        return self._stream("/v1/completions", _body(model, params, prompt=_prompt(prompt), stream=True))

    def stream_text(self, prompt: Prompt, *, model: str | None = None, **params: Any) -> Generator[str]:
        """Only the text of :meth:`stream_completions`, chunk by chunk."""
        stream = self.stream_completions(prompt, model=model, **params)
        try:
            for chunk in stream:
                if text := _chunk_text(chunk):
                    yield text
        finally:
            stream.close()

    def chat(self, messages: Messages, *, model: str | None = None, **params: Any) -> dict:
        return self._post("/v1/chat/completions", _body(model, params, messages=list(messages)))

    def stream_chat(self, messages: Messages, *, model: str | None = None, **params: Any) -> Events:
        """Chat completion chunks as dicts; the text of each is ``chunk["choices"][0]["delta"].get("content")``."""
        return self._stream("/v1/chat/completions", _body(model, params, messages=list(messages), stream=True))

    def embeddings(self, input: str | Sequence[Prompt], *, model: str | None = None, **params: Any) -> dict:
        return self._post("/v1/embeddings", _body(model, params, input=_embedding_input(input)))

    def models(self) -> dict:
        return self._request("GET", "/v1/models")

    # -- native routes --------------------------------------------------------------------------------------------

    def generate(self, prompt: Prompt, **params: Any) -> Events:
        """The native streaming route: one dict per event, as the server sends them."""
        return self._stream("/generate", _body(None, params, prompt=_prompt(prompt), stream=True))

    # -- transport ------------------------------------------------------------------------------------------------

    def _post(self, path: str, body: dict) -> dict:
        return self._request("POST", path, body)

    def _request(self, method: str, path: str, body: dict | None = None) -> dict:
        attempt = 1
        while True:
            with _translate_transport_errors():
                response = self._http.request(method, path, json=body)
            if response.is_success:
                return response.json()
            error = _error_from(response.status_code, response.headers, response.content)
            if (delay := self.retry.delay(attempt, error)) is None:
                raise error
            time.sleep(delay)
            attempt += 1

    def _stream(self, path: str, body: dict) -> Events:
        attempt = 1
        while True:
            with _translate_transport_errors(), self._http.stream("POST", path, json=body) as response:
                if response.is_success:
                    for line in response.iter_lines():
                        event = _parse_line(line)
                        if isinstance(event, _Done):
                            return
                        if event is not None:
                            yield event
                    return
                error = _error_from(response.status_code, response.headers, response.read())
            if (delay := self.retry.delay(attempt, error)) is None:
                raise error
            time.sleep(delay)
            attempt += 1


class AsyncClient:
    """Async client with the same methods as :class:`Client`; streaming methods return async generators."""

    def __init__(self, base_url: str = DEFAULT_BASE_URL, *, timeout: float | httpx.Timeout = DEFAULT_TIMEOUT_S,
                 retry: RetryPolicy | None = None, api_key: str | None = None,
                 transport: httpx.AsyncBaseTransport | None = None):
        self.retry = retry or RetryPolicy()
        self._http = httpx.AsyncClient(base_url=base_url, timeout=timeout, headers=_headers(api_key),
                                       transport=transport)

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc_info) -> None:
        await self.close()

    async def close(self) -> None:
        await self._http.aclose()

    async def completions(self, prompt: Prompt, *, model: str | None = None, **params: Any) -> dict:
        return await self._request("POST", "/v1/completions", _body(model, params, prompt=_prompt(prompt)))

    def stream_completions(self, prompt: Prompt, *, model: str | None = None, **params: Any) -> AsyncEvents:
        return self._stream("/v1/completions", _body(model, params, prompt=_prompt(prompt), stream=True))

    async def stream_text(self, prompt: Prompt, *, model: str | None = None, **params: Any) -> AsyncGenerator[str]:
        stream = self.stream_completions(prompt, model=model, **params)
        try:
            async for chunk in stream:
                if text := _chunk_text(chunk):
                    yield text
        finally:
            await stream.aclose()

    async def chat(self, messages: Messages, *, model: str | None = None, **params: Any) -> dict:
        return await self._request("POST", "/v1/chat/completions", _body(model, params, messages=list(messages)))

    def stream_chat(self, messages: Messages, *, model: str | None = None, **params: Any) -> AsyncEvents:
        return self._stream("/v1/chat/completions", _body(model, params, messages=list(messages), stream=True))

    async def embeddings(self, input: str | Sequence[Prompt], *, model: str | None = None, **params: Any) -> dict:
        return await self._request("POST", "/v1/embeddings", _body(model, params, input=_embedding_input(input)))

    async def models(self) -> dict:
        return await self._request("GET", "/v1/models")

    def generate(self, prompt: Prompt, **params: Any) -> AsyncEvents:
        return self._stream("/generate", _body(None, params, prompt=_prompt(prompt), stream=True))

    async def _request(self, method: str, path: str, body: dict | None = None) -> dict:
        attempt = 1
        while True:
            with _translate_transport_errors():
                response = await self._http.request(method, path, json=body)
            if response.is_success:
                return response.json()
            error = _error_from(response.status_code, response.headers, response.content)
            if (delay := self.retry.delay(attempt, error)) is None:
                raise error
            await asyncio.sleep(delay)
            attempt += 1

    async def _stream(self, path: str, body: dict) -> AsyncEvents:
        attempt = 1
        while True:
            with _translate_transport_errors():
                async with self._http.stream("POST", path, json=body) as response:
                    if response.is_success:
                        async for line in response.aiter_lines():
                            event = _parse_line(line)
                            if isinstance(event, _Done):
                                return
                            if event is not None:
                                yield event
                        return
                    error = _error_from(response.status_code, response.headers, await response.aread())
            if (delay := self.retry.delay(attempt, error)) is None:
                raise error
            await asyncio.sleep(delay)
            attempt += 1


# -- shared helpers -----------------------------------------------------------------------------------------------

def _headers(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def _prompt(prompt: Prompt) -> str | list[int]:
    return prompt if isinstance(prompt, str) else list(prompt)


def _embedding_input(value: str | Sequence[Prompt]) -> str | list:
    return value if isinstance(value, str) else [_prompt(v) if not isinstance(v, int) else v for v in value]


def _body(model: str | None, params: dict[str, Any], **fields: Any) -> dict:
    body = {k: v for k, v in params.items() if v is not None}
    if model is not None:
        body["model"] = model
    body.update(fields)
    return body


def _chunk_text(chunk: dict) -> str:
    choices = chunk.get("choices") or [{}]
    return choices[0].get("text") or ""


def _parse_line(line: str) -> dict | _Done | None:
    """One line of a stream: SSE ``data:`` lines and bare JSON lines (NDJSON) are events; SSE comments, ``event:``
    and ``id:`` lines and blank lines are not. An error object in the stream is raised."""
    line = line.strip()
    if line.startswith("data:"):
        line = line[5:].strip()
        if line == "[DONE]":
            return _DONE
    elif not line.startswith("{"):
        return None
    if not line:
        return None
    event = json.loads(line)
    if isinstance(event, dict) and isinstance(event.get("error"), (dict, str)) and len(event) == 1:
        raise _error_from_body(event, status=None)
    return event


def _error_from(status: int, headers: httpx.Headers, content: bytes) -> APIError:
    try:
        body = json.loads(content)
    except ValueError:
        body = {"error": {"message": content.decode(errors="replace").strip() or f"HTTP {status}"}}
    return _error_from_body(body, status, parse_retry_after(headers.get("retry-after")))


def _error_from_body(body: object, status: int | None, retry_after: float | None = None) -> APIError:
    """OpenAI's shape ``{"error": {"message", "type", "param", "code"}}``, or anything else reduced to a message."""
    error = body.get("error", body) if isinstance(body, dict) else body
    if isinstance(error, dict):
        message = str(error.get("message") or error.get("detail") or f"HTTP {status}")
        kind = error.get("type")
        code = error.get("code") or kind  # the reason (queue_full, rate_limited...) tells more than the type
        return APIError(message, status=status, code=str(code) if code is not None else None,
                        param=error.get("param"), retry_after=retry_after,
                        type=str(kind) if kind is not None else None)
    return APIError(str(error), status=status, retry_after=retry_after)


@contextmanager
def _translate_transport_errors() -> Iterator[None]:
    """Turn httpx's transport exceptions into :class:`APIConnectionError` / :class:`APITimeoutError`."""
    try:
        yield
    except httpx.TimeoutException as exc:
        raise APITimeoutError(f"{type(exc).__name__}: {exc}") from exc
    except httpx.TransportError as exc:
        raise APIConnectionError(f"{type(exc).__name__}: {exc}") from exc
