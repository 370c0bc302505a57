"""Each tool-call format: chosen by the chat template, its parse a pure function of the text (deltas over any
chunking add up to the final parse), its own rendering parsed back to the same calls, and its forcing grammar
accepting a call of a given function and refusing any other (checked with llguidance on the default model's
tokenizer)."""

from __future__ import annotations

import json

import llguidance as llg
import pytest

from rtxcore.server.serving.tool_calls import parse_tools, required_grammar
from rtxcore.server.serving.tool_formats import FORMATS, format_for

CALLS = [{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "get_time", "arguments": {"zone": "UTC"}}]
TOOLS = {"tools": [{"type": "function", "function": {
    "name": name, "parameters": {"type": "object", "properties": {key: {"type": "string"}}, "required": [key]}}}
    for name, key in (("get_weather", "city"), ("get_time", "zone"))]}
# What each family writes: text before the calls where the format allows it.
ANSWERS = {"hermes": "Let me check. " + FORMATS["hermes"].render(CALLS),
           "mistral": "Checking. " + FORMATS["mistral"].render(CALLS),
           "llama3_json": "<|python_tag|>" + FORMATS["llama3_json"].render(CALLS)}
CONTENT = {"hermes": "Let me check. ", "mistral": "Checking. ", "llama3_json": ""}


@pytest.mark.parametrize("template, name", [
    ("{% for m in messages %}{{ m.content }}{% endfor %}", "hermes"),
    ("{{ '[AVAILABLE_TOOLS]' }}{{ tools | tojson }}{{ '[TOOL_CALLS]' }}", "mistral"),
    ("{%- if tools %}{{ '<|python_tag|>' }}{% endif %}", "llama3_json"),
    (None, "hermes"),
])
def test_the_template_chooses_the_format(template, name):
    assert format_for(template).name == name


@pytest.mark.parametrize("name", sorted(FORMATS))
@pytest.mark.parametrize("step", [1, 5, 40])
def test_deltas_over_any_chunking_add_up_to_the_final_parse(name, step):
    fmt, text = FORMATS[name], ANSWERS[name]
    content, calls = "", []
    for end in range(step, len(text) + step, step):
        before = fmt.parse(text[:end - step], "c", final=False)
        after = fmt.parse(text[:end], "c", final=end >= len(text))
        assert after.content.startswith(before.content) and after.calls[:len(before.calls)] == before.calls
        content += after.content[len(before.content):]
        calls += after.calls[len(before.calls):]
    final = fmt.parse(text, "c", final=True)
    assert (content, calls) == (final.content, final.calls)
    assert content == CONTENT[name]
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == \
           [(c["name"], c["arguments"]) for c in CALLS]
    assert [c["id"] for c in calls] == ["c-0", "c-1"]


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_text_that_only_looks_like_a_call_stays_text(name):
    fmt = FORMATS[name]
    for text in ("The answer is 42.", "{not json", "[TOOL_CALLS] nothing", "<tool_call>\nno\n</tool_call>"):
        assert fmt.parse(text, "c", final=True).content == text
        assert fmt.parse(text, "c", final=True).calls == []


@pytest.fixture(scope="module")
def llg_tokenizer(default_source):
    tokenizer = default_source.tokenizer()
    return llg.LLTokenizer(tokenizer.backend.to_str(), n_vocab=tokenizer.vocab_size,
                           eos_token=[tokenizer.eos_token_id])


def _accepts(llg_tokenizer, grammar: str, text: str) -> bool:
    matcher = llg.LLMatcher(llg_tokenizer, grammar, log_level=0)
    assert not matcher.is_error(), matcher.get_error()
    return matcher.consume_tokens(llg_tokenizer.tokenize_str(text)) and matcher.is_accepting()


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_the_forcing_grammar_takes_a_call_of_the_named_function_only(name, llg_tokenizer):
    fmt = FORMATS[name]
    named = required_grammar(parse_tools({**TOOLS, "tool_choice": {"type": "function",
                                                                    "function": {"name": "get_weather"}}}), fmt)
    assert _accepts(llg_tokenizer, named, fmt.render(CALLS[:1]))
    assert not _accepts(llg_tokenizer, named, fmt.render(CALLS[1:]))
    assert not _accepts(llg_tokenizer, named, fmt.render([{**CALLS[0], "arguments": {"town": "Paris"}}]))
    several = required_grammar(parse_tools({**TOOLS, "tool_choice": "required"}), fmt)
    assert _accepts(llg_tokenizer, several, fmt.render(CALLS))
    one = required_grammar(parse_tools({**TOOLS, "tool_choice": "required", "parallel_tool_calls": False}), fmt)
    assert _accepts(llg_tokenizer, one, fmt.render(CALLS[1:])) and not _accepts(llg_tokenizer, one,
                                                                                  fmt.render(CALLS))
