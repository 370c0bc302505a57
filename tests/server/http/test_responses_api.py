"""OpenAI's Responses API (``POST /v1/responses``) through the official ``openai`` client against ``rtx serve`` on the
default model: the same answer as the chat request it translates to, streamed as typed, numbered events that the
client's own stream helper assembles; tools, a function call's output fed back, JSON schemas, and 400s naming the
Responses field. The translation and the items' order are also checked without a server."""

from __future__ import annotations

import json

import httpx
import jsonschema
import pytest

from rtxcore.engine.outputs import RequestOutput
from rtxcore.errors import InvalidRequestError
from rtxcore.server.http.responses_request import parse_responses
from rtxcore.server.serving.formats import ResponseSpec, make_format
from rtxcore.server.serving.generation import Choice
from tests.helpers.server import assert_error

WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 24},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"]}


# -- the translation, without a server -------------------------------------------------------------------------------


def test_input_items_become_chat_messages():
    translated = parse_responses({
        "instructions": "Be brief.", "max_output_tokens": 9, "temperature": 0, "seed": 3, "lane": "standard",
        "input": [{"role": "developer", "content": "Answer in French."},
                  {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Weather "},
                                                                  {"type": "input_text", "text": "in Paris?"}]},
                  {"type": "reasoning", "id": "rs_1", "summary": []},
                  {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
                  {"type": "function_call", "call_id": "c2", "name": "get_weather", "arguments": '{"city": "Lyon"}'},
                  {"type": "function_call_output", "call_id": "c1", "output": "Sunny"},
                  {"type": "function_call_output", "call_id": "c2",
                   "output": [{"type": "input_text", "text": "Rain"}]}],
        "tools": [WEATHER], "tool_choice": {"type": "function", "name": "get_weather"}, "parallel_tool_calls": False,
        "text": {"format": {"type": "json_schema", "name": "p", "schema": PERSON, "strict": True}},
        "include": ["message.output_text.logprobs"], "top_logprobs": 2, "metadata": {"k": "v"}})
    chat = translated.chat_body
    assert chat["messages"] == [
        {"role": "system", "content": "Be brief."}, {"role": "system", "content": "Answer in French."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
            {"id": "c2", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Lyon"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "Sunny"},
        {"role": "tool", "tool_call_id": "c2", "content": "Rain"}]
    assert chat["max_completion_tokens"] == 9 and chat["temperature"] == 0 and chat["seed"] == 3
    assert chat["lane"] == "standard"  # the extensions chat takes pass through
    assert chat["tools"] == [{"type": "function", "function": {k: WEATHER[k] for k in ("name", "description",
                                                                                          "parameters")}}]
    assert chat["tool_choice"] == {"type": "function", "function": {"name": "get_weather"}}
    assert chat["parallel_tool_calls"] is False
    assert chat["response_format"] == {"type": "json_schema",
                                       "json_schema": {"name": "p", "schema": PERSON, "strict": True}}
    assert chat["logprobs"] is True and chat["top_logprobs"] == 2
    for name in ("input", "instructions", "text", "include", "metadata", "max_output_tokens"):
        assert name not in chat
    echo = translated.echo
    assert echo["instructions"] == "Be brief." and echo["metadata"] == {"k": "v"} and echo["tools"] == [WEATHER]
    assert echo["text"]["format"]["type"] == "json_schema" and echo["store"] is False


@pytest.mark.parametrize("body, param", [
    ({"input": 3}, "input"),
    ({"input": []}, "input"),
    ({"input": [{"role": "system", "content": "only a system message"}]}, "input"),
    ({"input": [{"role": "robot", "content": "x"}]}, "input"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input"),
    ({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]}, "input"),
    ({"input": [{"type": "web_search_call"}]}, "input"),
    ({"input": "x", "previous_response_id": "resp_1"}, "previous_response_id"),
    ({"input": "x", "background": True}, "background"),
    ({"input": "x", "truncation": "auto"}, "truncation"),
    ({"input": "x", "store": "yes"}, "store"),
    ({"input": "x", "instructions": 5}, "instructions"),
    ({"input": "x", "metadata": {"k": 1}}, "metadata"),
    ({"input": "x", "max_output_tokens": 0}, "max_output_tokens"),
    ({"input": "x", "text": {"format": {"type": "xml"}}}, "text.format"),
    ({"input": "x", "text": {"format": {"type": "json_schema", "schema": {}}}}, "text.format"),
    ({"input": "x", "text": {"format": {"type": "json_schema", "name": "a", "schema": {}, "strict": "yes"}}},
     "text.format"),
    ({"input": "x", "tools": [{"type": "web_search"}]}, "tools"),
    ({"input": "x", "tools": [WEATHER], "tool_choice": {"type": "function"}}, "tool_choice"),
    ({"input": "x", "include": ["file_search_call.results"]}, "include"),
    ({"input": "x", "top_logprobs": 3}, "top_logprobs"),
])
def test_bad_fields_are_named(body, param):
    with pytest.raises(InvalidRequestError) as err:
        parse_responses(body)
    assert err.value.param == param, err.value.message


class _Gen:
    """What the Responses format reads of a generation while streaming: its id (the items' ids come from it)."""

    req_id = "r1"


CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


@pytest.mark.parametrize("pieces, message_at, num_calls", [
    (["Let me ", "check. ", CALL], 0, 1),        # text, then a call: the message comes first
    ([CALL, "\n", CALL], None, 2),               # calls only (the blank between them is no message)
    ([CALL, "\nDone, it is ", "sunny."], 1, 1),  # a call, then text: the message comes second
    ([CALL + "\nAll set."], 1, 1),               # both in one output
])
def test_items_follow_the_text_and_a_resumed_stream_agrees(pieces, message_at, num_calls):
    spec = ResponseSpec("responses", True, {"id": "resp_r1", "created_at": 0, "model": "m"}, tools="hermes",
                        request={})
    live = make_format(spec, None)
    choice = Choice(0, 5)
    added: dict[int, str] = {}
    texts: dict[int, str] = {}
    for i, piece in enumerate(pieces):
        out = RequestOutput("r1", [1], piece, finished=i == len(pieces) - 1, finish_reason="stop")
        choice.add(out)
        for event in live.events(_Gen(), choice, out):
            if event["type"] == "response.output_item.added":
                assert event["output_index"] not in added
                added[event["output_index"]] = event["item"]["type"]
            if event["type"] == "response.output_text.delta":
                texts[event["output_index"]] = texts.get(event["output_index"], "") + event["delta"]
    calls = [i for i, kind in added.items() if kind == "function_call"]
    assert len(calls) == num_calls
    assert [i for i, kind in added.items() if kind == "message"] == ([] if message_at is None else [message_at])
    assert sorted(added) == list(range(len(added)))  # indices without gaps
    if message_at is not None:
        assert texts[message_at].strip() and CALL not in texts[message_at]
        # A format rebuilt after a restart places the message where the live one did, from the text alone.
        assert make_format(spec, None)._message_at(choice.text, "call_r1", True) == message_at


# -- against a server ------------------------------------------------------------------------------------------------


@pytest.mark.model
def test_same_answer_as_chat_and_a_stream_that_adds_up(client):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}]
    chat = client.chat.completions.create(model="smollm2-135m", messages=messages, max_tokens=24, temperature=0)
    response = client.responses.create(model="smollm2-135m", instructions="Be brief.", input="Name a colour.",
                                       max_output_tokens=24, temperature=0)
    assert response.object == "response" and response.id.startswith("resp_")
    assert response.output_text == chat.choices[0].message.content
    assert response.usage is not None and chat.usage is not None
    assert response.usage.input_tokens == chat.usage.prompt_tokens
    assert response.usage.output_tokens == chat.usage.completion_tokens
    assert response.instructions == "Be brief." and response.max_output_tokens == 24
    expected = ("completed", None) if chat.choices[0].finish_reason == "stop" else ("incomplete", "max_output_tokens")
    assert (response.status, response.incomplete_details and response.incomplete_details.reason) == expected

    events = list(client.responses.create(model="smollm2-135m", instructions="Be brief.", input="Name a colour.",
                                          max_output_tokens=24, temperature=0, stream=True))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:-1] == ["response.output_text.done", "response.content_part.done", "response.output_item.done"]
    assert kinds[-1] == ("response.completed" if expected[0] == "completed" else "response.incomplete")
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == response.output_text == events[-1].response.output_text
    assert len({e.response.id for e in events if hasattr(e, "response")}) == 1


@pytest.mark.model
def test_stream_helper_assembles_the_final_response(client):
    with client.responses.stream(model="smollm2-135m", input=[{"role": "user", "content": "Say hello."}],
                                 max_output_tokens=200, temperature=0) as stream:
        deltas = "".join(e.delta for e in stream if e.type == "response.output_text.delta")
        final = stream.get_final_response()
    assert final.status == "completed" and final.output_text == deltas and deltas


@pytest.mark.model
def test_incomplete_at_max_output_tokens(client):
    response = client.responses.create(model="smollm2-135m", input="Tell me a long story.", max_output_tokens=3)
    assert response.status == "incomplete" and response.incomplete_details is not None
    assert response.incomplete_details.reason == "max_output_tokens" and response.usage.output_tokens == 3
    assert [item.status for item in response.output] == ["incomplete"]
    last = list(client.responses.create(model="smollm2-135m", input="Tell me a long story.", max_output_tokens=3,
                                        stream=True))[-1]
    assert last.type == "response.incomplete"


@pytest.mark.model
def test_forced_call_then_its_output_fed_back(client):
    response = client.responses.create(model="smollm2-135m", input="What's the weather in Paris?", tools=[WEATHER],
                                       tool_choice="required", temperature=0)
    calls = [item for item in response.output if item.type == "function_call"]
    assert calls and calls[0].name == "get_weather" and "city" in json.loads(calls[0].arguments)
    assert response.tools[0].name == "get_weather"

    events = list(client.responses.create(model="smollm2-135m", input="What's the weather in Paris?",
                                          tools=[WEATHER], tool_choice={"type": "function", "name": "get_weather"},
                                          temperature=0, stream=True))
    done = [e.item for e in events if e.type == "response.output_item.done" and e.item.type == "function_call"]
    assert len(done) == 1 and done[0].arguments == "".join(
        e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert json.loads(done[0].arguments) == json.loads(calls[0].arguments)  # one call, as required's first

    call = calls[0]
    conversation = [{"role": "user", "content": "What's the weather in Paris?"},
                    {"type": "function_call", "call_id": call.call_id, "name": call.name,
                     "arguments": call.arguments},
                    {"type": "function_call_output", "call_id": call.call_id, "output": "Sunny, 21 C"}]
    answer = client.responses.create(model="smollm2-135m", input=conversation, tools=[WEATHER], tool_choice="none",
                                     max_output_tokens=24, temperature=0)
    chat = client.chat.completions.create(
        model="smollm2-135m", max_tokens=24, temperature=0, tool_choice="none",
        tools=[{"type": "function", "function": {k: WEATHER[k] for k in ("name", "description", "parameters")}}],
        messages=[conversation[0], {"role": "assistant", "content": "", "tool_calls": [
            {"id": call.call_id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}]},
            {"role": "tool", "tool_call_id": call.call_id, "content": "Sunny, 21 C"}])
    assert answer.output_text == chat.choices[0].message.content


@pytest.mark.model
def test_json_schema_output_validates(client):
    for subject in ("a baker", "a pilot", "a sailor"):
        response = client.responses.create(
            model="smollm2-135m", input=f"Describe {subject} as JSON.", max_output_tokens=80, temperature=0.7,
            text={"format": {"type": "json_schema", "name": "person", "schema": PERSON, "strict": True}})
        jsonschema.validate(json.loads(response.output_text), PERSON)


@pytest.mark.model
def test_errors_name_the_responses_field(server):
    def post(body: dict) -> httpx.Response:
        return httpx.post(server.base_url + "/v1/responses", json={"model": "smollm2-135m", **body}, timeout=120)

    assert_error(post({"input": "x", "previous_response_id": "resp_1"}), 400, "previous_response_id")
    assert_error(post({"input": "x", "temperature": "hot"}), 400, "temperature")
    # A schema the grammar engine refuses: named by text.format, not by chat's response_format.
    assert_error(post({"input": "x", "text": {"format": {"type": "json_schema", "name": "a",
                                                         "schema": {"type": "objekt"}}}}), 400, "text.format")
    assert_error(post({"input": "x", "model": "another-model"}), 404, "model")


@pytest.mark.model
def test_a_stream_resumes_after_a_crash_with_the_same_numbered_events(tmp_path):
    """Cut the journal of a finished Responses stream after 9 events: the restarted server resumes it, and a client
    that had seen 6 gets exactly the rest, sequence numbers included."""
    from rtxcore.engine.config import EngineConfig
    from rtxcore.server.serving.runtime import ServeSettings, ServingRuntime
    from tests.helpers.durable_app import crash_copy, events, records, serving

    def runtime(state_dir):
        served = ServingRuntime(EngineConfig(), ServeSettings(state_dir=str(state_dir)))
        served.load()
        assert served.load_error is None
        return served

    body = {"input": "Count from one to ten.", "max_output_tokens": 24, "temperature": 0, "ignore_eos": True,
            "stream": True}
    with serving(runtime(tmp_path / "run")) as client:
        sent = client.post("/v1/responses", json=body)
    assert sent.status_code == 200
    req_id = sent.headers["x-rtx-request-id"]
    sent_events = events(sent.text)
    assert [json.loads(data)["sequence_number"] for _, data in sent_events] == list(range(len(sent_events)))
    # A crash leaves a prefix of the records: here up to the one journaling event 9.
    cut = next(i for i, r in enumerate(records(tmp_path / "run")) if r.get("seq") == 9)
    crashed = crash_copy(tmp_path / "run", tmp_path / "crashed", lambda r, i: i <= cut)
    with serving(runtime(crashed)) as client:
        resumed = client.get(f"/v1/streams/{req_id}", headers={"Last-Event-ID": "6"})
    assert resumed.status_code == 200 and events(resumed.text) == sent_events[6:]
    assert [r["t"] for r in records(crashed) if r["id"] == req_id].count("finish") == 1
