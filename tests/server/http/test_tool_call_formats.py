"""A chat template of another model family brings its own tool-call format: served with a Llama-3.1-style template,
a forced call is written as Llama writes it and comes back as ``tool_calls``, whole and streamed (the default model,
``rtx serve --chat-template``)."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from tests.helpers.server import start_server

pytestmark = pytest.mark.model

# The parts of Llama 3.1's template that matter here: a tools variable, <|python_tag|> calls, and a date_string
# variable that requests set through chat_template_kwargs.
LLAMA_STYLE = """{%- if date_string is defined %}Today Date: {{ date_string }}
{% endif %}
{%- if tools %}<|start_header_id|>system<|end_header_id|>

Functions: {{ tools | tojson }}. Answer with <|python_tag|>{"name": ..., "parameters": ...}.<|eot_id|>
{%- endif %}
{%- for m in messages %}<|start_header_id|>{{ m.role }}<|end_header_id|>

{{ m.content }}<|eot_id|>{% endfor %}<|start_header_id|>assistant<|end_header_id|>

"""
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
                   "required": ["city"]}}}]
FORCED = {"type": "function", "function": {"name": "get_weather"}}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    template = tmp_path_factory.mktemp("template") / "llama.jinja"
    template.write_text(LLAMA_STYLE)
    server = start_server("--no-grpc", "--chat-template", str(template))
    yield server
    assert server.stop() == 0, server.output()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="x", max_retries=0, timeout=300)


def test_chat_template_kwargs_reach_the_template(server, client):
    messages = [{"role": "user", "content": "What day is it?"}]
    dated = {"messages": messages, "chat_template_kwargs": {"date_string": "7 Dec 2026"}}
    with httpx.Client(base_url=server.base_url, timeout=300) as http:
        plain = http.post("/tokenize", json={"messages": messages}).json()
        tok = http.post("/tokenize", json=dated).json()
        text = http.post("/detokenize", json={"tokens": tok["tokens"]}).json()["prompt"]
    assert text.startswith("Today Date: 7 Dec 2026\n") and tok["count"] > plain["count"]
    response = client.chat.completions.create(model="smollm2-135m", messages=messages, max_tokens=2,
                                              extra_body={"chat_template_kwargs": dated["chat_template_kwargs"]})
    assert response.usage.prompt_tokens == tok["count"]


def test_a_forced_call_in_llama_format_comes_back_as_tool_calls(client):
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    response = client.chat.completions.create(model="smollm2-135m", messages=messages, tools=TOOLS,
                                              tool_choice=FORCED, max_tokens=40, temperature=0)
    choice = response.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather" and set(json.loads(call.function.arguments)) == {"city"}
    streamed = [d for chunk in client.chat.completions.create(
        model="smollm2-135m", messages=messages, tools=TOOLS, tool_choice=FORCED, max_tokens=40, temperature=0,
        stream=True) for c in chunk.choices for d in (c.delta.tool_calls or [])]
    assert [(d.function.name, d.function.arguments) for d in streamed] == [("get_weather", call.function.arguments)]
