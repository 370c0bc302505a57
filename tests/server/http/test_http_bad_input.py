"""Bad input against ``rtx serve`` on the default model, as clients send it: each answer a JSON error with its
status and the field at fault, never a 5xx, and the server serving on (the server and clients: conftest.py). The rest
of the HTTP server as clients see it is in test_http_server.py."""

from __future__ import annotations

import gzip

import openai
import pytest

from tests.helpers.server import assert_error

MODEL = "smollm2-135m"
PROMPT = "The capital of France is"
CHAT = [{"role": "user", "content": "What is the capital of France?"}]

pytestmark = pytest.mark.model


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
    ("/v1/completions", {"prompt": "hi", "max_tokens": 4, "min_tokens": 5}, 400, "min_tokens"),
    ("/v1/chat/completions", {"messages": CHAT, "min_tokens": -1}, 400, "min_tokens"),
    ("/generate", {"prompt": "hi", "min_tokens": "2"}, 400, "min_tokens"),
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
    # A compressed body is named as such, not "not valid JSON"; identity is no compression.
    packed = gzip.compress(b'{"prompt": "hi", "max_tokens": 1}')
    gzipped = assert_error(http.post("/v1/completions", content=packed, headers={"content-encoding": "gzip"}), 415)
    assert gzipped["code"] == "unsupported_media_type" and "'gzip'" in gzipped["message"]
    assert http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1, "seed": -5},
                     headers={"content-encoding": "identity"}).status_code == 200  # and any int64 seed
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
