"""Structured output and logit_bias through the official ``openai`` client against ``rtx serve`` on the default
model: every answer parses and validates, errors name the field the body used."""

from __future__ import annotations

import asyncio
import json
import re

import httpx
import jsonschema
import openai
import pydantic
import pytest

from tests.helpers.server import assert_error, start_server

pytestmark = pytest.mark.model

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "city": {"type": "string", "maxLength": 24},
        "hobbies": {"type": "array", "items": {"type": "string", "maxLength": 16}, "maxItems": 3},
    },
    "required": ["name", "age", "city", "hobbies"],
}
SUBJECTS = ["a baker", "a pilot", "a teacher", "a farmer", "a nurse", "a painter", "a chess player", "a sailor",
            "a poet", "a doctor", "a student", "a chef", "a runner", "a singer", "a judge", "a miner", "a diver",
            "a clerk", "a gardener", "a mechanic"]


@pytest.fixture(scope="module")
def server():
    srv = start_server()  # with gRPC: structured output through it too
    yield srv
    assert srv.stop() == 0, srv.output()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="x", max_retries=0, timeout=300)


def _messages(text: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": text}]


def test_json_schema_answers_validate_for_20_prompts(server):
    async def one(client: openai.AsyncOpenAI, subject: str) -> str:
        response = await client.chat.completions.create(
            model="smollm2-135m", messages=_messages(f"Describe {subject} as a JSON object."), max_tokens=120,
            temperature=0.7, seed=len(subject),
            response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON,
                                                                    "strict": True}})
        assert response.choices[0].finish_reason == "stop"
        return response.choices[0].message.content or ""

    async def run() -> list[str]:
        async with openai.AsyncOpenAI(base_url=server.base_url + "/v1", api_key="x", max_retries=0,
                                      timeout=300) as client:
            return await asyncio.gather(*(one(client, s) for s in SUBJECTS))

    answers = asyncio.run(run())
    assert len(set(answers)) > 1
    for text in answers:
        value = json.loads(text)
        jsonschema.validate(value, PERSON)
        assert set(value) == set(PERSON["properties"])  # strict: no other keys


def test_the_client_parses_into_a_pydantic_model(client):
    class Pet(pydantic.BaseModel):
        name: str
        legs: int

    completion = client.chat.completions.parse(model="smollm2-135m", messages=_messages("Invent a pet."),
                                               response_format=Pet, max_tokens=60, temperature=0)
    pet = completion.choices[0].message.parsed
    assert isinstance(pet, Pet)


def test_json_object_and_vllm_extras(client):
    ask = _messages('Give the JSON object {"name": "Ada"}.')
    chat = client.chat.completions.create(model="smollm2-135m", messages=ask,
                                          response_format={"type": "json_object"}, max_tokens=100, temperature=0)
    # A 135M model can run on inside a string for ever; this prompt's answer (greedy: always the same) ends.
    assert chat.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(chat.choices[0].message.content or ""), dict)
    regex = client.completions.create(model="smollm2-135m", prompt="The date today is", max_tokens=12,
                                      temperature=0, extra_body={"structured_outputs": {"regex": r"\d{4}-\d\d-\d\d"}})
    assert re.fullmatch(r"\d{4}-\d\d-\d\d", regex.choices[0].text)
    choice = client.completions.create(model="smollm2-135m", prompt="My favourite colour is", max_tokens=5,
                                       temperature=0, extra_body={"guided_choice": ["red", "green", "blue"]})
    assert choice.choices[0].text in ("red", "green", "blue")
    stream = client.chat.completions.create(model="smollm2-135m", messages=_messages("Yes or no?"), stream=True,
                                            max_tokens=5, temperature=0,
                                            extra_body={"structured_outputs": {"choice": ["yes", "no"]}})
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) in ("yes", "no")


def test_logit_bias_through_the_client(server, client):
    [token_id] = _token_ids(server, " banana")
    forced = client.completions.create(model="smollm2-135m", prompt="The capital of France is", max_tokens=3,
                                       temperature=0, logit_bias={str(token_id): 100})
    assert forced.choices[0].text == " banana" * 3
    plain = client.completions.create(model="smollm2-135m", prompt="The capital of France is", max_tokens=1,
                                      temperature=0)
    greedy = _token_ids(server, plain.choices[0].text)[0]
    banned = client.completions.create(model="smollm2-135m", prompt="The capital of France is", max_tokens=1,
                                       temperature=0, logit_bias={str(greedy): -100})
    assert banned.choices[0].text != plain.choices[0].text


def test_logprobs_of_alternatives_a_grammar_forbids(server):
    # With a grammar, most of the top five alternatives are impossible (-inf): the answer is still JSON (200, not a
    # 500 from the encoder; no -Infinity in a stream), those alternatives at the floor of -9999.
    body = {"messages": _messages("hi"), "max_tokens": 3, "logprobs": True, "top_logprobs": 5, "temperature": 0,
            "response_format": {"type": "json_object"}}
    whole = httpx.post(server.base_url + "/v1/chat/completions", json=body, timeout=60)
    assert whole.status_code == 200, whole.text
    [first, *_] = whole.json()["choices"][0]["logprobs"]["content"]
    assert first["token"].startswith("{") and first["top_logprobs"][-1]["logprob"] == -9999.0
    with httpx.stream("POST", server.base_url + "/v1/chat/completions", json={**body, "stream": True},
                      timeout=60) as stream:
        events = [line[6:] for line in stream.iter_lines() if line.startswith("data: {")]
    assert events and "Infinity" not in "".join(events) and "NaN" not in "".join(events)
    completion = httpx.post(server.base_url + "/v1/completions", timeout=60, json={
        "prompt": "x", "max_tokens": 2, "logprobs": 3, "allowed_token_ids": [5]})
    assert completion.status_code == 200 and completion.json()["choices"][0]["logprobs"]["token_logprobs"] == [0, 0]


def _token_ids(server, text: str) -> list[int]:
    body = {"prompt": text, "add_special_tokens": False}
    return httpx.post(server.base_url + "/tokenize", json=body, timeout=30).json()["tokens"]


@pytest.mark.parametrize(("body", "param", "reason"), [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strnig"}}}},
     "response_format", "strnig"),
    ({"response_format": {"type": "xml"}}, "response_format", "json_schema"),
    ({"response_format": {"type": "json_schema"}}, "response_format", "name"),
    ({"guided_regex": "(unclosed"}, "guided_regex", ""),
    ({"structured_outputs": {"grammar": "root ::= nowhere"}}, "structured_outputs", "nowhere"),
    ({"structured_outputs": {"yaml": "x"}}, "structured_outputs", "yaml"),
    ({"structured_outputs": {}}, "structured_outputs", "one kind"),
    ({"structured_outputs": {"json_object": False}}, "structured_outputs", "one kind"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {}, "strict": "yes"}}},
     "response_format", "strict"),
    ({"guided_choice": ["a"], "response_format": {"type": "json_object"}}, "guided_choice", "only one"),
    ({"logit_bias": {"12": 500}}, "logit_bias", "[-100, 100]"),
    ({"logit_bias": {"999999": 1}}, "logit_bias", "vocabulary"),
    ({"allowed_token_ids": []}, "allowed_token_ids", "empty"),
    ({"allowed_token_ids": [5], "banned_token_ids": [5]}, "banned_token_ids", "nothing could be sampled"),
    ({"banned_token_ids": list(range(49152))}, "banned_token_ids", "nothing could be sampled"),
    ({"logits_processors": {"nope": 1}}, "logits_processors", "nope"),
])
def test_bad_values_answer_400_naming_the_field(server, body, param, reason):
    response = httpx.post(server.base_url + "/v1/chat/completions", timeout=60,
                          json={"messages": _messages("hi"), "max_tokens": 4, **body})
    error = assert_error(response, 400, param)
    assert reason in error["message"], error


# Grammars llguidance compiles and then gives up on as generation reaches them: the client's error, not the server's.
RECURSIVE = {"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]}
TOO_BIG_REGEX = "a{1000000}"


@pytest.mark.parametrize(("path", "body", "param"), [
    ("/v1/chat/completions", {"messages": _messages("hi"), "guided_regex": TOO_BIG_REGEX}, "guided_regex"),
    ("/v1/chat/completions", {"messages": _messages("hi"), "response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": RECURSIVE}}}, "response_format"),
    ("/v1/completions", {"prompt": "hi", "n": 2, "guided_regex": TOO_BIG_REGEX}, "guided_regex"),
    ("/v1/responses", {"input": "hi", "text": {"format": {"type": "json_schema", "name": "x", "schema": RECURSIVE}}},
     "text.format"),
    ("/generate", {"prompt": "hi", "structured_output": {"regex": TOO_BIG_REGEX}}, "structured_output"),
])
def test_a_grammar_the_engine_gives_up_on_midway_answers_400_naming_its_field(server, path, body, param):
    limit = "max_output_tokens" if path == "/v1/responses" else "max_tokens"
    response = httpx.post(server.base_url + path, timeout=120, json={**body, limit: 4})
    error = assert_error(response, 400, param)
    assert error["message"].startswith(f"{param}: the grammar engine gave up on this grammar"), error
    # The server goes on serving.
    assert httpx.post(server.base_url + "/v1/completions", timeout=60,
                      json={"prompt": "hi", "max_tokens": 2}).status_code == 200


def test_a_streamed_request_whose_grammar_is_given_up_on_before_its_first_token_answers_400(server):
    # The engine gives up on these at the first step, before the stream's 200 is sent.
    response = httpx.post(server.base_url + "/v1/chat/completions", timeout=120, json={
        "messages": _messages("hi"), "max_tokens": 4, "stream": True, "guided_regex": TOO_BIG_REGEX})
    assert "gave up on this grammar" in assert_error(response, 400, "guided_regex")["message"]


# -- tools -------------------------------------------------------------------------------------------------------------

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"]}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "Current time in a time zone.",
    "parameters": {"type": "object", "properties": {"zone": {"type": "string", "maxLength": 30}},
                   "required": ["zone"]}}}
CITIES = ["Paris", "Tokyo", "Lima", "Oslo", "Cairo", "Perth", "Quito", "Dakar", "Seoul", "Rome", "Delhi", "Nairobi",
          "Austin", "Hanoi", "Bergen", "Porto", "Kyiv", "Accra", "Havana", "Riga"]


def test_a_forced_tool_call_parses_for_20_prompts(server):
    async def one(client: openai.AsyncOpenAI, city: str):
        response = await client.chat.completions.create(
            model="smollm2-135m", messages=_messages(f"What is the weather like in {city}?"), max_tokens=80,
            temperature=0.8, seed=len(city), tools=[WEATHER, TIME],
            tool_choice={"type": "function", "function": {"name": "get_weather"}})
        return response.choices[0]

    async def run():
        async with openai.AsyncOpenAI(base_url=server.base_url + "/v1", api_key="x", max_retries=0,
                                      timeout=300) as client:
            return await asyncio.gather(*(one(client, c) for c in CITIES))

    for choice in asyncio.run(run()):
        assert choice.finish_reason == "tool_calls", choice.message
        [call] = choice.message.tool_calls[:1]
        assert call.function.name == "get_weather" and call.id
        arguments = json.loads(call.function.arguments)
        jsonschema.validate(arguments, WEATHER["function"]["parameters"])


def test_streamed_tool_call_deltas_reassemble_the_call(client):
    ask = {"model": "smollm2-135m", "messages": _messages("What time is it in Tokyo?"), "max_tokens": 80,
           "temperature": 0, "tools": [WEATHER, TIME], "tool_choice": "required", "parallel_tool_calls": False}
    whole = client.chat.completions.create(**ask).choices[0]
    calls: dict[int, dict[str, str]] = {}
    finish = None
    for chunk in client.chat.completions.create(**ask, stream=True):
        for choice in chunk.choices:
            for delta in choice.delta.tool_calls or []:
                entry = calls.setdefault(delta.index, {"id": "", "name": "", "arguments": ""})
                entry["id"] += delta.id or ""
                entry["name"] += delta.function.name or ""
                entry["arguments"] += delta.function.arguments or ""
            finish = choice.finish_reason or finish
    assert finish == whole.finish_reason == "tool_calls"
    assert [(c["name"], json.loads(c["arguments"])) for c in calls.values()] == \
        [(c.function.name, json.loads(c.function.arguments)) for c in whole.message.tool_calls]


def test_tool_results_go_back_to_the_model_and_auto_may_answer(client):
    call = {"id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": json.dumps({"city": "Oslo", "unit": "celsius"})}}
    messages = [*_messages("What is the weather in Oslo?"),
                {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "call_1", "content": "3 degrees and snowing"}]
    answer = client.chat.completions.create(model="smollm2-135m", messages=messages, max_tokens=40, temperature=0,
                                            tools=[WEATHER], tool_choice="none")
    assert answer.choices[0].message.content and not answer.choices[0].message.tool_calls
    # "none" still shows the model the tools, as OpenAI and vLLM do; it only may not call them.
    plain, shown = (client.chat.completions.create(model="smollm2-135m", messages=_messages("Weather in Lima?"),
                                                   max_tokens=1, **extra).usage.prompt_tokens
                    for extra in ({}, {"tools": [WEATHER], "tool_choice": "none"}))
    assert shown > plain + 20
    auto = client.chat.completions.create(model="smollm2-135m", messages=_messages("Weather in Lima?"),
                                          max_tokens=80, temperature=0, tools=[WEATHER])
    message = auto.choices[0].message
    assert message.content or message.tool_calls
    for tool_call in message.tool_calls or []:
        assert tool_call.function.name == "get_weather"
        json.loads(tool_call.function.arguments)


@pytest.mark.parametrize(("body", "param"), [
    ({"tools": "get_weather"}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools"),
    ({"tools": [WEATHER, WEATHER]}, "tools"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": "always"}, "tool_choice"),
    ({"tools": [WEATHER], "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
    ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "strnig"}}}],
      "tool_choice": "required"}, "tools"),
    # The model may answer in text, but a schema no call could be held to is refused all the same.
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "strnig"}}}]}, "tools"),
    ({"tools": [WEATHER, {"type": "function", "function": {"name": "g", "parameters": {"properties": 5}}}],
      "tool_choice": "auto"}, "tools"),
    # An earlier turn's calls fed back: each must be OpenAI's shape, whatever the chat template does with them.
    ({"tools": [WEATHER], "messages": [{"role": "user", "content": "x"},
                                       {"role": "assistant", "tool_calls": [{"function": "get_weather"}]}]},
     "messages"),
    ({"tools": [WEATHER], "messages": [{"role": "user", "content": "x"},
                                       {"role": "assistant", "tool_calls": "get_weather"}]}, "messages"),
    ({"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "tool_calls": [
        {"type": "function", "function": {"name": "get_weather", "arguments": [1]}}]}]}, "messages"),
])
def test_bad_tool_fields_answer_400(server, body, param):
    response = httpx.post(server.base_url + "/v1/chat/completions", timeout=60,
                          json={"messages": _messages("hi"), "max_tokens": 4, **body})
    assert_error(response, 400, param)


# -- gRPC ---------------------------------------------------------------------------------------------------------


def test_grpc_structured_output_and_token_lists(server):
    import grpc

    from rtxcore.server.grpc.codegen import ensure_generated

    ensure_generated()
    from rtxcore._generated import rtx_pb2, rtx_pb2_grpc

    def generate(**fields) -> str:
        with grpc.insecure_channel(server.grpc_target) as channel:
            stub = rtx_pb2_grpc.RtxStub(channel)
            return "".join(r.text for r in stub.Generate(rtx_pb2.GenerateRequest(
                text="Describe a baker as JSON:", max_tokens=120, temperature=0.7, seed=1, **fields), timeout=300))

    jsonschema.validate(json.loads(generate(json_schema=json.dumps(PERSON))), PERSON)
    assert generate(choice=rtx_pb2.Choices(items=["yes", "no"])) in ("yes", "no")
    assert re.fullmatch(r"[0-9]{3}-[0-9]{4}", generate(regex=r"[0-9]{3}-[0-9]{4}"))
    with grpc.insecure_channel(server.grpc_target) as channel:
        stub = rtx_pb2_grpc.RtxStub(channel)
        for fields, param in [({"json_schema": "{not json"}, "json_schema"),
                              ({"json_schema": '{"const": NaN}'}, "json_schema"),
                              ({"regex": "(unclosed"}, "structured_output"),
                              ({"regex": TOO_BIG_REGEX}, "structured_output"),  # given up on, not INTERNAL
                              ({"logit_bias": {1: 500.0}}, "logit_bias")]:
            with pytest.raises(grpc.RpcError) as info:
                list(stub.Generate(rtx_pb2.GenerateRequest(text="hi", max_tokens=4, **fields), timeout=60))
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, fields
            assert dict(info.value.trailing_metadata())["rtx-param"] == param, info.value.details()
