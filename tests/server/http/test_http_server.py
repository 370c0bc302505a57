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
def http(server):
    with httpx.Client(base_url=server.base_url, timeout=120) as c:
        yield c


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
    assert all(len(top) <= 2 and max(top.values()) >= chosen - 1e-4
               for top, chosen in zip(lp.top_logprobs, lp.token_logprobs))
    assert "".join(lp.tokens) == resp.choices[0].text
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


# -- bad input ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("path, body, status, param", [
    ("/v1/completions", {}, 400, "prompt"),
    ("/v1/completions", {"prompt": ""}, 400, "prompt"),
    ("/v1/completions", {"prompt": []}, 400, "prompt"),
    ("/v1/completions", {"prompt": [[1, 2], "x", 3]}, 400, "prompt"),
    ("/v1/completions", {"prompt": [[1, 2], "x"]}, 400, "prompt"),
    ("/generate", {"prompt": [[1, 2]]}, 400, "prompt"),
    ("/v1/completions", {"prompt": "hi", "user": 123}, 400, "user"),
    ("/v1/chat/completions", {"messages": CHAT, "max_tokens": -1, "max_completion_tokens": 5}, 400, "max_tokens"),
    ("/v1/embeddings", {"input": [-1]}, 400, "input"),
    ("/embed", {"inputs": [-1]}, 400, "inputs"),
    ("/v1/completions", {"prompt": [10**9]}, 400, "prompt"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": "ten"}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 10**12}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "temperature": -1}, 400, "temperature"),
    ("/v1/completions", {"prompt": "hi", "top_p": 0}, 400, "top_p"),
    ("/v1/completions", {"prompt": "hi", "stop": 5}, 400, "stop"),
    ("/v1/completions", {"prompt": "hi", "stop": [""]}, 400, "stop"),
    ("/v1/completions", {"prompt": "hi", "n": 0}, 400, "n"),
    ("/v1/completions", {"prompt": ["a", "b"], "n": 200}, 400, "n"),
    ("/v1/completions", {"prompt": "hi", "n": 3, "best_of": 2}, 400, "best_of"),
    ("/v1/completions", {"prompt": "hi", "best_of": 2, "stream": True}, 400, "best_of"),
    ("/v1/completions", {"prompt": "hi", "echo": "yes"}, 400, "echo"),
    ("/v1/chat/completions", {"messages": CHAT, "n": "two"}, 400, "n"),
    ("/v1/completions", {"prompt": "hi", "logprobs": 50}, 400, "logprobs"),
    ("/v1/completions", {"prompt": "hi", "stream_options": {"include_usage": True}}, 400, "stream_options"),
    ("/v1/completions", {"prompt": "hi", "model": "gpt-4"}, 404, "model"),
    ("/v1/chat/completions", {"model": MODEL}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"content": "hi"}]}, 400, "messages"),
    ("/v1/chat/completions", {"messages": CHAT, "top_logprobs": 2}, 400, "top_logprobs"),
    ("/v1/chat/completions", {"messages": CHAT, "max_tokens": 10**9, "stream": True}, 400, "max_tokens"),
    ("/v1/chat/completions", {"messages": CHAT, "logprobs": True, "top_logprobs": 25}, 400, "top_logprobs"),
    ("/v1/chat/completions", {"messages": CHAT, "max_completion_tokens": 0}, 400, "max_completion_tokens"),
    ("/v1/completions", {"prompt": "hi", "top_k": True}, 400, "top_k"),
    ("/v1/completions", {"prompt": "hi", "seed": True}, 400, "seed"),
    ("/generate", {"prompt": "hi", "logprobs": False}, 400, "logprobs"),
    ("/v1/embeddings", {"input": []}, 400, "input"),
    ("/v1/embeddings", {"input": "hi", "model": "nope"}, 404, "model"),
    ("/generate", {"prompt": "hi", "bogus": 1}, 400, "bogus"),
    ("/generate", {"prompt": "hi", "top_k": -3}, 400, "top_k"),
    ("/generate", {"prompt": "hi", "draft_token_ids": [10**9]}, 400, "draft_token_ids"),
    ("/v1/chat/completions", {"messages": CHAT, "prediction": {"type": "content", "content": 1}}, 400, "prediction"),
    ("/v1/completions", {"prompt": "hi", "speculative": "no"}, 400, "speculative"),
    ("/embed", {"inputs": ""}, 400, "inputs"),
    ("/v1/completions", {"prompt": "hi", "temperature": "hot"}, 400, "temperature"),
    ("/v1/completions", {"prompt": "hi", "stop_token_ids": [2**70]}, 400, "stop_token_ids"),
    ("/v1/completions", {"prompt": "hi", "logit_bias": {"\u00b2": 1}}, 400, "logit_bias"),
    # A falsy value of the wrong type is still the wrong type.
    ("/v1/completions", {"prompt": "hi", "echo": 0}, 400, "echo"),
    ("/v1/chat/completions", {"messages": CHAT, "logprobs": ""}, 400, "logprobs"),
    ("/v1/embeddings", {"input": "hi", "user": 5}, 400, "user"),
    ("/v1/chat/completions", {"messages": [{"role": "usr", "content": "hi"}]}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user"}]}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [*CHAT, {"role": "tool", "content": "4"}]}, 400, "messages"),
    ("/tokenize", {"messages": [{"role": "", "content": "hi"}]}, 400, "messages"),
    # The output budget is named as the body named it.
    ("/v1/chat/completions", {"messages": CHAT, "max_completion_tokens": 10**6}, 400, "max_completion_tokens"),
    ("/v1/responses", {"input": "hi", "max_output_tokens": 10**6}, 400, "max_output_tokens"),
])
def test_bad_input_gets_its_status_and_a_json_error(http, path, body, status, param):
    assert_error(http.post(path, json=body), status, param)


@pytest.mark.parametrize("field", ["temperature", "top_p", "repetition_penalty", "presence_penalty"])
def test_numbers_past_floats_range_are_refused(http, field):
    # JSON's 1e400 parses as infinity (and Infinity too, in Python's json): refused, not sampled with.
    for number in (b"1e400", b"1" + b"0" * 400):
        body = b'{"prompt": "hi", "max_tokens": 2, "%s": %s}' % (field.encode(), number)
        assert "finite number" in assert_error(http.post("/v1/completions", content=body), 400, field)["message"]
    # NaN and Infinity are not JSON, though Python's json reads them: a body holding one is refused whole (one was
    # echoed into a Responses answer that Starlette could not write: a 500).
    for constant in (b"NaN", b"-Infinity"):
        body = b'{"prompt": "hi", "max_tokens": 2, "%s": %s}' % (field.encode(), constant)
        error = assert_error(http.post("/v1/completions", content=body), 400)
        assert error["code"] == "invalid_json" and constant.decode() in error["message"], error


def test_bad_requests_outside_the_body(http, client):
    assert assert_error(http.post("/v1/completions", content=b'{"prompt": "hi",'), 400)["code"] == "invalid_json"
    assert_error(http.post("/v1/completions", content=b"\xff\xfe not utf-8"), 400)
    assert_error(http.post("/v1/completions", content=b"[" * 100_000), 400)
    assert_error(http.post("/v1/completions", content=b""), 400)
    array = assert_error(http.post("/v1/completions", json=[1, 2]), 400)
    assert array["code"] == "invalid_value" and "got an array" in array["message"]
    # Valid JSON, but a lone surrogate is no text any tokenizer takes: the field is named, wherever it is.
    assert_error(http.post("/v1/completions", content=b'{"prompt": "a\\ud800"}'), 400, "prompt")
    lone = b'{"messages": [{"role": "user", "content": [{"type": "text", "text": "\\udfff"}]}]}'
    assert_error(http.post("/v1/chat/completions", content=lone), 400, "messages[0].content[0].text")
    assert_error(http.post("/tokenize", content=b'{"prompt": "\\ud800x"}'), 400, "prompt")
    # Encoded surrogates (not escapes) are not UTF-8: not JSON either. A surrogate pair is an emoji, and fine.
    assert_error(http.post("/tokenize", content=b'{"prompt": "a\xed\xa0\x80"}'), 400)
    assert_error(http.post("/tokenize", content='{"prompt": "\\ud800"}'.encode("utf-16-le")), 400)
    assert http.post("/tokenize", content=b'{"prompt": "\\ud83d\\ude00"}').status_code == 200
    deep = b'{"prompt": "hi", "x": ' + b"[" * 1400 + b'"\\u00e9"' + b"]" * 1400 + b"}"
    assert http.post("/tokenize", content=deep).status_code in (200, 400)
    deeper = b'{"prompt": "hi", "x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    assert "nested too deeply" in assert_error(http.post("/tokenize", content=deeper), 400)["message"]
    responses_nan = b'{"input": "hi", "max_output_tokens": 2, "text": {"format": {"type": "json_object", "x": NaN}}}'
    assert assert_error(http.post("/v1/responses", content=responses_nan), 400)["code"] == "invalid_json"
    assert_error(http.get("/v2/nothing"), 404)
    error = assert_error(http.get("/v1/completions"), 405)
    assert error["code"] == "method_not_allowed"
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt="hi", temperature=-2)
    assert info.value.status_code == 400 and "temperature" in info.value.message
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-4o", messages=CHAT)


def test_sse_breaking_inputs_do_not_break_the_server(server, http, client):
    # Too many tokens: refused before any event is sent.
    with http.stream("POST", "/v1/completions", json={"prompt": "hi", "max_tokens": 2**62, "stream": True}) as r:
        r.read()
        assert_error(r, 400, "max_tokens")
    # A 1 MB prompt is far longer than the context.
    for stream in (False, True):
        assert_error(http.post("/v1/completions", json={"prompt": "word " * 200_000, "stream": stream}), 400,
                     "prompt")
    # Unicode stop strings, and prompts that look like SSE framing.
    stops = ["😀", "日本", "é", "\n"]
    resp = client.completions.create(model=MODEL, prompt="Répète: café, 日本, 😀 et", max_tokens=16, temperature=0,
                                     stop=stops)
    assert not any(s in resp.choices[0].text for s in stops)
    text = "".join(c.choices[0].text for c in client.completions.create(
        model=MODEL, prompt="data: [DONE]\n\n\r\nevent: error\n\ndata: {\"x\": 1}\n\n", max_tokens=12,
        temperature=0, stream=True, stop=["ü", "∞"]))
    assert "ü" not in text and "∞" not in text
    # Still serving, and nothing above was a 5xx.
    assert client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2).usage.completion_tokens == 2
    assert " 500 " not in server.stderr and "Traceback" not in server.stderr
