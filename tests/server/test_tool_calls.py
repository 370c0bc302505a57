"""Tool-call parsing, a pure function of the text: streamed deltas add up to the whole answer's calls, whatever the
chunking, and text that only looks like a call stays text."""

from __future__ import annotations

import json

import pytest

from rtxcore.errors import InvalidRequestError
from rtxcore.server.serving.tool_calls import parse_output, parse_tools, required_grammar

CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
TEXT = f"Let me check. {CALL}{CALL.replace('Paris', 'Lima')} Done <tool"


@pytest.mark.parametrize("step", [1, 3, 7, 50])
def test_deltas_over_any_chunking_add_up_to_the_final_parse(step):
    content, calls = "", []
    for end in range(step, len(TEXT) + step, step):
        before = parse_output(TEXT[:end - step], "c", final=False)
        after = parse_output(TEXT[:end], "c", final=end >= len(TEXT))
        assert after.content.startswith(before.content) and after.calls[:len(before.calls)] == before.calls
        content += after.content[len(before.content):]
        calls += after.calls[len(before.calls):]
    final = parse_output(TEXT, "c", final=True)
    assert (content, calls) == (final.content, final.calls) == ("Let me check.  Done <tool", final.calls)
    assert [json.loads(c["function"]["arguments"])["city"] for c in calls] == ["Paris", "Lima"]
    assert [c["id"] for c in calls] == ["c-0", "c-1"]


def test_a_call_that_does_not_parse_stays_text():
    text = "<tool_call>\nnot json\n</tool_call>"
    assert parse_output(text, "c", final=True).content == text


def test_a_required_call_has_a_grammar_and_auto_has_none():
    body = {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]}
    assert required_grammar(parse_tools(body)) is None
    grammar = required_grammar(parse_tools({**body, "tool_choice": "required", "parallel_tool_calls": False}))
    assert grammar.startswith("start: call\n") and '"const": "f"' in grammar
    with pytest.raises(InvalidRequestError) as info:
        parse_tools({**body, "tool_choice": {"type": "function", "function": {"name": "g"}}})
    assert info.value.param == "tool_choice"
