"""The HTTP server as clients see it: ``rtx serve`` in a subprocess on 127.0.0.1, driven by the official ``openai``
client and by httpx.

One server on the real default model serves these tests (module scope). The limits that need their own settings
and the graceful shutdown are in test_http_limits.py; the app's pieces, tested in-process, in test_http_app.py.
"""

from __future__ import annotations

import asyncio
import math

import httpx
import openai
import pytest

from rtxcore.sampling_params import SamplingParams
from tests.helpers.server import (
    assert_error,
    http_status,
    metric,
    sse_events,
    start_server,
    wait_for,
)

MODEL = "smollm2-135m"
PROMPT = "The capital of France is"
CHAT = [{"role": "user", "content": "What is the capital of France?"}]

pytestmark = pytest.mark.model


# -- fixtures and helpers ----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def server():
    srv = start_server("--no-grpc", wait_ready=False)
    # The model takes seconds to load: probes and model routes must answer meanwhile.
    srv.while_loading = {
        "health": http_status(srv.base_url + "/health"),
        "ready": http_status(srv.base_url + "/ready"),
        "completions": httpx.post(srv.base_url + "/v1/completions", json={"prompt": "hi"}),
    }
    srv.wait_ready()
    yield srv
    assert srv.stop() == 0, srv.output()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="x", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def offline_greedy(default_engine):
    """The engine's own output for PROMPT and for CHAT, greedy, 16 tokens."""
    params = SamplingParams(max_tokens=16, temperature=0.0)
    chat_prompt = default_engine.inputs.apply_chat_template(CHAT)
    # One at a time, as the server runs them in these tests.
    return default_engine.generate([PROMPT], params)[0], default_engine.generate([chat_prompt], params)[0]


# -- start-up ----------------------------------------------------------------------------------------------------


def test_prints_address_model_and_backend(server):
    assert f"rtx serve: {server.base_url} model={MODEL} backend=torch" in server.stdout


def test_probes_and_model_routes_while_loading(server):
    assert server.while_loading["health"] == 200
    assert server.while_loading["ready"] == 503
    assert_error(server.while_loading["completions"], 503)
    assert server.while_loading["completions"].headers["retry-after"]


def test_health_ready_models(server, client, http):
    assert http.get("/health").json()["status"] == "ok"
    assert http.get("/ready").json() == {"status": "ready", "model": MODEL, "backend": "torch"}
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("no-such-model")


def test_serve_defaults_to_the_default_model_on_localhost():
    from rtxcore.cli.main import build_parser

    args = build_parser().parse_args(["serve"])
    assert (args.host, args.port, args.model, args.no_grpc) == ("127.0.0.1", 8000, None, False)


# -- OpenAI client -----------------------------------------------------------------------------------------------


def test_greedy_completion_equals_offline(client, offline_greedy):
    expected = offline_greedy[0]
    resp = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=16, temperature=0)
    assert resp.id.startswith("cmpl-") and resp.model == MODEL
    assert resp.choices[0].text == expected.text
    assert resp.choices[0].finish_reason == expected.finish_reason
    assert resp.usage.prompt_tokens == len(expected.prompt_token_ids)
    assert resp.usage.completion_tokens == len(expected.token_ids)
    assert resp.usage.total_tokens == resp.usage.prompt_tokens + resp.usage.completion_tokens


def test_greedy_completion_stream_equals_offline(client, offline_greedy):
    expected = offline_greedy[0]
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=16, temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == expected.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == expected.finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(expected.token_ids)


def test_greedy_chat_equals_offline(client, offline_greedy):
    expected = offline_greedy[1]
    resp = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=16, temperature=0)
    assert resp.id.startswith("chatcmpl-")
    assert resp.choices[0].message.role == "assistant"
    assert resp.choices[0].message.content == expected.text
    assert resp.choices[0].finish_reason == expected.finish_reason
    assert resp.usage.completion_tokens == len(expected.token_ids)
    assert resp.usage.prompt_tokens == len(expected.prompt_token_ids)


def test_greedy_chat_stream_equals_offline(client, offline_greedy):
    expected = offline_greedy[1]
    chunks = list(client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=16, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == expected.finish_reason
    assert chunks[-1].usage.completion_tokens == len(expected.token_ids)


def test_chat_default_max_tokens_runs_to_eos(client):
    resp = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Say hi."}],
                                          temperature=0)
    assert resp.choices[0].finish_reason == "stop"
    assert resp.choices[0].message.content


def test_several_prompts_are_choices(client, default_engine):
    token_ids = default_engine.tokenizer.encode("Once upon a time")
    resp = client.completions.create(model=MODEL, prompt=[PROMPT, "1, 2, 3,"], max_tokens=5, temperature=0,
                                     extra_body={"ignore_eos": True})
    assert [c.index for c in resp.choices] == [0, 1]
    assert resp.usage.completion_tokens == 10
    by_ids = client.completions.create(model=MODEL, prompt=[token_ids, token_ids], max_tokens=4, temperature=0)
    assert [c.index for c in by_ids.choices] == [0, 1]
    assert by_ids.usage.prompt_tokens == 2 * len(token_ids)


def test_logprobs(client):
    resp = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0, logprobs=2)
    lp = resp.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == resp.usage.completion_tokens
    # The two most likely, and the sampled token among them (OpenAI's and vLLM's: up to logprobs + 1 entries).
    assert all(len(top) in (2, 3) and max(top.values()) >= chosen - 1e-4 and top[token] == pytest.approx(chosen)
               for top, chosen, token in zip(lp.top_logprobs, lp.token_logprobs, lp.tokens))
    assert "".join(lp.tokens) == resp.choices[0].text
    only = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0, logprobs=0,
                                     extra_body={"stream": None})  # null: not streamed, as OpenAI takes it
    lp0 = only.choices[0].logprobs
    assert [list(top) for top in lp0.top_logprobs] == [[t] for t in lp0.tokens] and only.choices[0].text
    chat = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=4, temperature=0, logprobs=True,
                                          top_logprobs=3)
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens
    assert all(len(c.top_logprobs) == 3 and c.logprob <= 0 for c in content)


def test_sampling_parameters_and_seed(client):
    kwargs = dict(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0.9, top_p=0.9, seed=1234,
                  presence_penalty=0.5, frequency_penalty=0.5, user="someone",
                  extra_body={"top_k": 40, "min_p": 0.05, "repetition_penalty": 1.1})
    first = client.completions.create(**kwargs)
    second = client.completions.create(**kwargs)
    assert first.choices[0].text == second.choices[0].text


def test_embeddings(client, http):
    resp = client.embeddings.create(model=MODEL, input=["hello world", "hello world", "goodbye"])
    vectors = [d.embedding for d in resp.data]
    assert [d.index for d in resp.data] == [0, 1, 2]
    assert vectors[0] == vectors[1] != vectors[2]
    assert all(abs(math.fsum(x * x for x in v) - 1) < 1e-4 for v in vectors)
    assert resp.usage.prompt_tokens > 0
    native = http.post("/embed", json={"inputs": ["hello world"]}).json()
    assert native["embeddings"][0] == pytest.approx(vectors[0], abs=1e-6)


def test_32_concurrent_streams_complete_with_their_token_counts(server):
    """Each chunk carries its tokens' logprobs, so the client counts tokens itself, and checks the usage too."""
    num_tokens = 10

    async def one(client: openai.AsyncOpenAI, i: int) -> tuple[int, int, str | None]:
        stream = await client.completions.create(
            model=MODEL, prompt=f"Story number {i}:", max_tokens=num_tokens, temperature=0.8, seed=i, logprobs=0,
            stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
        counted, usage, finish = 0, None, None
        async for chunk in stream:
            if chunk.choices:
                counted += len(chunk.choices[0].logprobs.tokens)
                finish = chunk.choices[0].finish_reason or finish
            if chunk.usage:
                usage = chunk.usage.completion_tokens
        return counted, usage, finish

    async def main():
        async with openai.AsyncOpenAI(base_url=server.base_url + "/v1", api_key="x", max_retries=0,
                                      timeout=180) as client:
            return await asyncio.gather(*(one(client, i) for i in range(32)))

    results = asyncio.run(main())
    assert results == [(num_tokens, num_tokens, "length")] * 32


# -- native API --------------------------------------------------------------------------------------------------


def test_native_generate(http, offline_greedy):
    expected = offline_greedy[0]
    body = {"prompt": PROMPT, "max_tokens": 16, "temperature": 0.0}
    resp = http.post("/generate", json={**body, "stream": False}).json()
    assert resp["text"] == expected.text and resp["num_tokens"] == len(expected.token_ids)
    with http.stream("POST", "/generate", json=body) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        events = list(sse_events(r))
    assert "".join(e["text"] for e in events) == expected.text
    assert sum(len(e["token_ids"]) for e in events) == len(expected.token_ids)
    assert events[-1]["finished"] and events[-1]["usage"]["completion_tokens"] == len(expected.token_ids)


# -- request ids, tracing ----------------------------------------------------------------------------------------


def test_request_id_and_traceparent(http):
    trace_id, parent_id = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
    resp = http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 1},
                     headers={"x-request-id": "my req/42", "traceparent": f"00-{trace_id}-{parent_id}-01"})
    assert resp.headers["x-request-id"] == "myreq42"
    assert resp.json()["id"] == "cmpl-myreq42"
    version, trace, parent, flags = resp.headers["traceparent"].split("-")
    assert (version, trace, flags) == ("00", trace_id, "01") and parent != parent_id and len(parent) == 16
    # No (or a broken) traceparent: a fresh trace; no request id: a fresh one. Errors carry both too.
    for headers in ({}, {"traceparent": "00-00000000000000000000000000000000-00f067aa0ba902b7-01"}):
        error = http.post("/v1/completions", json={}, headers=headers)
        assert error.status_code == 400
        assert len(error.headers["x-request-id"]) >= 16
        assert error.headers["traceparent"].split("-")[1] not in (trace_id, "0" * 32)


# -- client disconnects ------------------------------------------------------------------------------------------


def test_disconnect_mid_stream_aborts_and_frees_kv(server, http):
    idle_usage = metric(server, "rtx_kv_cache_usage_ratio")
    aborts = metric(server, "rtx_request_aborts_total")
    body = {"prompt": PROMPT, "max_tokens": 2000, "stream": True, "ignore_eos": True}
    with http.stream("POST", "/v1/completions", json=body) as r:
        events = sse_events(r)
        next(events), next(events)
        assert metric(server, "rtx_kv_cache_usage_ratio") > idle_usage
    # Leaving the block closed the connection mid-stream.
    assert wait_for(lambda: metric(server, "rtx_request_aborts_total") == aborts + 1)
    assert wait_for(lambda: metric(server, "rtx_kv_cache_usage_ratio") == idle_usage)


def test_disconnect_while_waiting_for_a_full_response_aborts(server):
    aborts = metric(server, "rtx_request_aborts_total")
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.base_url + "/v1/completions", timeout=1.5,
                   json={"prompt": PROMPT, "max_tokens": 2000, "ignore_eos": True})
    assert wait_for(lambda: metric(server, "rtx_request_aborts_total") == aborts + 1)
    assert wait_for(lambda: metric(server, "rtx_kv_cache_usage_ratio") == 0)
