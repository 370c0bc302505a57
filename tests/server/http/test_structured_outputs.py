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
    srv = start_server("--no-grpc")
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
    ({"guided_choice": ["a"], "response_format": {"type": "json_object"}}, "guided_choice", "only one"),
    ({"logit_bias": {"12": 500}}, "logit_bias", "[-100, 100]"),
    ({"logit_bias": {"999999": 1}}, "logit_bias", "vocabulary"),
    ({"allowed_token_ids": []}, "allowed_token_ids", "empty"),
    ({"logits_processors": {"nope": 1}}, "logits_processors", "nope"),
])
def test_bad_values_answer_400_naming_the_field(server, body, param, reason):
    response = httpx.post(server.base_url + "/v1/chat/completions", timeout=60,
                          json={"messages": _messages("hi"), "max_tokens": 4, **body})
    error = assert_error(response, 400, param)
    assert reason in error["message"], error
