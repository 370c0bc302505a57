"""The Python clients (HTTP and gRPC, sync and async) against a real ``rtx serve``: results, streaming, errors,
cancellation aborting the server's request, and retries honouring ``Retry-After``."""

from __future__ import annotations

import asyncio
import json
import re
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest

from rtxcore.client import (
    NO_RETRY,
    APIError,
    APITimeoutError,
    AsyncClient,
    AsyncGrpcClient,
    Client,
    GrpcClient,
    RetryPolicy,
)
from rtxcore.client.retry import parse_retry_after
from tests.helpers.server import start_server

PROMPT = "The capital of France is"
GREEDY = {"max_tokens": 6, "temperature": 0.0}


@pytest.fixture(scope="module")
def server():
    """``rtx serve`` on the real default model, with its HTTP and gRPC ports."""
    process = start_server()
    yield process
    process.stop()


@pytest.fixture(scope="module")
def expected_text(server) -> str:
    """The greedy completion of PROMPT, from a plain HTTP request: every client must stream exactly this."""
    response = httpx.post(f"{server.base_url}/v1/completions", json={"prompt": PROMPT, **GREEDY}, timeout=60)
    response.raise_for_status()
    return response.json()["choices"][0]["text"]


def metric(base_url: str, name: str) -> float:
    text = httpx.get(f"{base_url}/metrics").text
    return sum(float(m.group(1)) for m in re.finditer(rf"^{name}(?:{{.*}})? (\S+)$", text, re.MULTILINE))


def wait_for(predicate, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def wait_idle(server) -> None:
    """Wait until the server runs no request (an earlier test's abort may still be landing)."""
    assert wait_for(lambda: metric(server.base_url, "rtx_num_requests_running") == 0
                    and metric(server.base_url, "rtx_num_requests_waiting") == 0, timeout_s=60)


# -- HTTP ---------------------------------------------------------------------------------------------------------

def test_http_client(server, expected_text):
    with Client(server.base_url) as client:
        completion = client.completions(PROMPT, **GREEDY)
        assert completion["choices"][0]["text"] == expected_text
        assert completion["usage"]["completion_tokens"] == GREEDY["max_tokens"]

        chunks = list(client.stream_completions(PROMPT, **GREEDY))
        assert "".join(c["choices"][0]["text"] for c in chunks) == expected_text
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"

        native = list(client.generate(PROMPT, **GREEDY))
        assert "".join(e["text"] for e in native) == expected_text
        assert native[-1]["finished"] and native[-1]["usage"]["completion_tokens"] == GREEDY["max_tokens"]

        messages = [{"role": "user", "content": "Say hello."}]
        chat = client.chat(messages, **GREEDY)["choices"][0]["message"]["content"]
        chunks = client.stream_chat(messages, **GREEDY)
        streamed = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)
        assert chat and streamed == chat

        embeddings = client.embeddings(["hello", "world"])["data"]
        assert len(embeddings) == 2 and len(embeddings[0]["embedding"]) > 0

        assert client.models()["data"][0]["id"]


def test_async_http_client(server, expected_text):
    async def main():
        async with AsyncClient(server.base_url) as client:
            completion = await client.completions(PROMPT, **GREEDY)
            native = [e async for e in client.generate(PROMPT, **GREEDY)]
            text = [t async for t in client.stream_text(PROMPT, **GREEDY)]
            embeddings = await client.embeddings("hello")
            return completion, native, text, embeddings

    completion, native, text, embeddings = asyncio.run(main())
    assert completion["choices"][0]["text"] == expected_text
    assert "".join(e["text"] for e in native) == expected_text
    assert "".join(text) == expected_text
    assert len(embeddings["data"]) == 1


def test_http_errors_carry_status_and_field(server):
    with Client(server.base_url) as client:
        with pytest.raises(APIError) as info:
            client.completions(PROMPT, top_p=1.5)
        assert (info.value.status, info.value.param) == (400, "top_p")
        assert (info.value.code, info.value.type) == ("invalid_value", "invalid_request_error")
        assert "top_p" in info.value.message
        with pytest.raises(APIError) as info:
            list(client.stream_completions(PROMPT, model="no-such-model"))
        assert info.value.status == 404


def test_closing_an_http_stream_aborts_the_request(server):
    wait_idle(server)
    aborts = metric(server.base_url, "rtx_request_aborts_total")
    with Client(server.base_url) as client:
        stream = client.generate(PROMPT, max_tokens=2000, ignore_eos=True)
        for _ in range(3):
            next(stream)
        stream.close()
    assert wait_for(lambda: metric(server.base_url, "rtx_request_aborts_total") == aborts + 1)


async def cancel_mid_stream(client, open_stream) -> None:
    """Consume ``open_stream(client)`` until its first event arrives, then cancel the consuming task."""
    async with client:
        started = asyncio.Event()

        async def consume():
            async for _ in open_stream(client):
                started.set()

        task = asyncio.create_task(consume())
        await started.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task


def test_cancelling_an_async_http_stream_aborts_the_request(server):
    wait_idle(server)
    aborts = metric(server.base_url, "rtx_request_aborts_total")

    asyncio.run(cancel_mid_stream(AsyncClient(server.base_url),
                                  lambda c: c.stream_completions(PROMPT, max_tokens=2000, ignore_eos=True)))
    assert wait_for(lambda: metric(server.base_url, "rtx_request_aborts_total") == aborts + 1)


def test_http_timeout_gives_up_and_the_server_aborts(server):
    wait_idle(server)
    aborts = metric(server.base_url, "rtx_request_aborts_total")
    with Client(server.base_url, timeout=0.5, retry=NO_RETRY) as client:
        with pytest.raises(APITimeoutError):
            client.completions(PROMPT, max_tokens=2000, ignore_eos=True)
    assert wait_for(lambda: metric(server.base_url, "rtx_request_aborts_total") == aborts + 1)


# -- gRPC ---------------------------------------------------------------------------------------------------------

def test_grpc_client(server, expected_text):
    with GrpcClient(server.grpc_target) as client:
        assert client.health() == "SERVING"
        assert client.health("rtx.v1.Rtx") == "SERVING"
        responses = list(client.generate(PROMPT, **GREEDY))
        assert "".join(r.text for r in responses) == expected_text
        assert responses[-1].finished and responses[-1].finish_reason == "length"
        assert responses[-1].usage.completion_tokens == GREEDY["max_tokens"]
        embedded = client.embed(["hello", "world"])
        assert len(embedded.embeddings) == 2 and embedded.prompt_tokens > 0


def test_async_grpc_client(server, expected_text):
    async def main():
        async with AsyncGrpcClient(server.grpc_target) as client:
            status = await client.health()
            texts = await asyncio.gather(collect_text(client), collect_text(client))  # batched together
            embedded = await client.embed("hello")
            return status, texts, embedded

    async def collect_text(client):
        return "".join([r.text async for r in client.generate(PROMPT, **GREEDY)])

    status, texts, embedded = asyncio.run(main())
    assert status == "SERVING"
    assert texts == [expected_text, expected_text]
    assert len(embedded.embeddings) == 1


def test_grpc_errors_carry_code_and_field(server):
    with GrpcClient(server.grpc_target) as client:
        with pytest.raises(APIError) as info:
            list(client.generate(PROMPT, top_p=1.5))
        assert (info.value.code, info.value.param) == ("INVALID_ARGUMENT", "top_p")
        wait_idle(server)
        aborts = metric(server.base_url, "rtx_request_aborts_total")
        with pytest.raises(APITimeoutError) as info:
            list(client.generate(PROMPT, max_tokens=2000, ignore_eos=True, timeout=0.5))
        assert info.value.code == "DEADLINE_EXCEEDED"
    assert wait_for(lambda: metric(server.base_url, "rtx_request_aborts_total") == aborts + 1)


def test_closing_a_grpc_stream_aborts_the_request_and_frees_its_kv_cache(server):
    wait_idle(server)
    aborts = metric(server.base_url, "rtx_request_aborts_total")
    idle_usage = metric(server.base_url, "rtx_kv_cache_usage_ratio")
    with GrpcClient(server.grpc_target) as client:
        stream = client.generate(PROMPT, max_tokens=2000, ignore_eos=True)
        for _ in range(3):
            assert not next(stream).finished
        assert metric(server.base_url, "rtx_kv_cache_usage_ratio") > idle_usage
        stream.close()
    assert wait_for(lambda: metric(server.base_url, "rtx_request_aborts_total") == aborts + 1)
    assert wait_for(lambda: metric(server.base_url, "rtx_num_requests_running") == 0)
    assert metric(server.base_url, "rtx_kv_cache_usage_ratio") == idle_usage


def test_cancelling_an_async_grpc_stream_aborts_the_request(server):
    wait_idle(server)
    aborts = metric(server.base_url, "rtx_request_aborts_total")

    asyncio.run(cancel_mid_stream(AsyncGrpcClient(server.grpc_target),
                                  lambda c: c.generate(PROMPT, max_tokens=2000, ignore_eos=True)))
    assert wait_for(lambda: metric(server.base_url, "rtx_request_aborts_total") == aborts + 1)


# -- retries ------------------------------------------------------------------------------------------------------

class _Flaky:
    """A stdlib HTTP server on 127.0.0.1 that answers ``status`` with ``Retry-After`` for the first
    ``num_failures`` requests, then 200 with a completion (or an SSE stream)."""

    def __init__(self, status: int, retry_after: str | None, num_failures: int):
        self.times: list[float] = []
        flaky = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                self.rfile.read(int(self.headers.get("content-length") or 0))
                flaky.times.append(time.monotonic())
                if len(flaky.times) <= num_failures:
                    body = json.dumps({"error": {"message": "busy", "type": "rate_limit_error"}}).encode()
                    self.send_response(status)
                    if retry_after is not None:
                        self.send_header("Retry-After", retry_after)
                    self._send(body, "application/json")
                elif self.path.endswith("/completions"):
                    self.send_response(200)
                    self._send(json.dumps({"choices": [{"text": "ok"}]}).encode(), "application/json")
                else:
                    self.send_response(200)
                    self._send(b'data: {"text": "o"}\n\ndata: {"text": "k", "finished": true}\n\n',
                               "text/event-stream")

            def _send(self, body: bytes, content_type: str):
                self.send_header("Content-Type", content_type)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc_info):
        self.httpd.shutdown()
        self.httpd.server_close()


def test_retry_honours_retry_after_on_429():
    with _Flaky(429, "1", num_failures=1) as flaky, Client(flaky.url, retry=RetryPolicy(backoff_s=0)) as client:
        assert client.completions("hi")["choices"][0]["text"] == "ok"
    assert len(flaky.times) == 2
    assert 1.0 <= flaky.times[1] - flaky.times[0] < 2.5


def test_async_streaming_retry_honours_retry_after_on_503():
    async def main(url):
        async with AsyncClient(url, retry=RetryPolicy(backoff_s=0)) as client:
            return [e["text"] async for e in client.generate("hi")]

    with _Flaky(503, "1", num_failures=1) as flaky:
        assert asyncio.run(main(flaky.url)) == ["o", "k"]
    assert len(flaky.times) == 2
    assert 1.0 <= flaky.times[1] - flaky.times[0] < 2.5


def test_retries_are_bounded():
    policy = RetryPolicy(max_attempts=3, backoff_s=0.01)
    with _Flaky(429, None, num_failures=10) as flaky, Client(flaky.url, retry=policy) as client:
        with pytest.raises(APIError) as info:
            client.completions("hi")
    assert info.value.status == 429 and info.value.message == "busy"
    assert info.value.code == info.value.type == "rate_limit_error"  # a body without a code: its type
    assert len(flaky.times) == 3


def test_a_retry_after_too_long_is_not_waited_for():
    policy = RetryPolicy(max_retry_after_s=5)
    with _Flaky(503, "3600", num_failures=1) as flaky, Client(flaky.url, retry=policy) as client:
        with pytest.raises(APIError) as info:
            client.completions("hi")
    assert info.value.retry_after == 3600
    assert len(flaky.times) == 1


def test_other_errors_are_not_retried():
    with _Flaky(400, "1", num_failures=1) as flaky, Client(flaky.url) as client:
        with pytest.raises(APIError):
            client.completions("hi")
    assert len(flaky.times) == 1


def test_parse_retry_after():
    assert parse_retry_after("2") == 2.0
    assert parse_retry_after(" 1.5 ") == 1.5
    assert parse_retry_after("Wed, 21 Oct 2015 07:28:00 GMT", now=1445412470.0) == 10.0
    assert parse_retry_after("Wed, 21 Oct 2015 07:28:00 GMT", now=1445412490.0) == 0.0
    assert parse_retry_after("soon") is None
    assert parse_retry_after(None) is None


def test_grpc_takes_the_stop_string_and_special_token_fields_of_http(server, expected_text):
    """include_stop_str_in_output and skip_special_tokens were HTTP-only."""
    stop = expected_text.split()[1]  # a word of the greedy completion: it ends the output there
    chat = "<|im_start|>user\nSay hi.<|im_end|>\n<|im_start|>assistant\n"
    with GrpcClient(server.grpc_target) as client:
        def text(chat_prompt: str | None = PROMPT, **fields) -> str:
            return "".join(r.text for r in client.generate(chat_prompt or chat, **{**GREEDY, **fields}))

        cut, kept = text(stop=[stop]), text(stop=[stop], include_stop_str_in_output=True)
        assert not cut.endswith(stop) and kept == cut + stop and expected_text.startswith(kept), (cut, kept)
        texts = {}
        for skip in (True, False):
            # <|im_end|> (id 2) forced three times: in the text only when special tokens are not skipped.
            over_http = httpx.post(f"{server.base_url}/generate", timeout=60, json={
                "prompt": chat, "max_tokens": 3, "temperature": 0, "ignore_eos": True, "logit_bias": {"2": 100},
                "skip_special_tokens": skip, "stream": False})
            texts[skip] = text(chat_prompt=None, max_tokens=3, ignore_eos=True, logit_bias={2: 100.0},
                               skip_special_tokens=skip)
            assert texts[skip] == over_http.json()["text"], (skip, texts[skip], over_http.json()["text"])
        assert texts == {True: "", False: "<|im_end|>" * 3}, texts
