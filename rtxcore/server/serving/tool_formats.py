"""How a model family writes tool calls, one class per format: the instructions a model whose template does not
know tools gets, earlier calls written back as the model would have written them, the grammar that forces a call,
and the parser that turns the model's text back into calls.

A format is chosen by the chat template (:func:`format_for`): Mistral's templates write ``[TOOL_CALLS]``, Llama
3.1+'s know ``<|python_tag|>``; every other model gets Hermes' ``<tool_call>`` tags, which Qwen 2.5, Hermes and
SmolLM3 write. Parsing is a pure function of the text so far (a stream resumed after a restart emits exactly the
deltas it would have emitted): while a call may still be forming, its text is held back.
"""

from __future__ import annotations

import json
import re
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

# JSON as small models should write it (see rtx_plugins.logits_processors.structured_output).
LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


@dataclass(slots=True, frozen=True)
class ParsedOutput:
    # Text outside complete calls, less what may still become a call (unless the output is final).
    content: str
    calls: list[dict[str, Any]]


class ToolCallFormat(ABC):
    # Its name in a journaled ResponseSpec.
    name: str
    # The key a call's arguments go under.
    arguments_key = "arguments"
    # Whether the output must keep special tokens: the format's tags are special tokens in its family's vocabulary
    # (skipped, the calls would vanish from the text).
    keeps_special_tokens = False

    @abstractmethod
    def instructions(self) -> str:
        """How to write a call, for the system message of a model whose template does not know tools."""

    @abstractmethod
    def render(self, calls: list[dict[str, Any]]) -> str:
        """Earlier calls (``{"name", "arguments"}``), as the model writes them."""

    @abstractmethod
    def grammar(self, call_schema: dict[str, Any], several: bool) -> str:
        """A Lark grammar (llguidance's dialect, JSON Schema embedded with ``%json``) holding the output to one call
        matching ``call_schema``, or with ``several`` one or more."""

    @abstractmethod
    def parse(self, text: str, call_id_prefix: str, final: bool) -> ParsedOutput:
        """Split the model's text into content and calls; a call that does not parse stays content."""

    def call(self, value: Any, call_id_prefix: str, index: int) -> dict[str, Any] | None:
        """An OpenAI ``tool_calls`` entry from one decoded call object; None when it is not one."""
        if not isinstance(value, dict) or not isinstance(value.get("name"), str):
            return None
        arguments = value.get("arguments", value.get("parameters", {}))
        return {"id": f"{call_id_prefix}-{index}", "type": "function",
                "function": {"name": value["name"], "arguments": json.dumps(arguments, ensure_ascii=False)}}

    def _object(self, call: dict[str, Any]) -> dict[str, Any]:
        return {"name": call["name"], self.arguments_key: call["arguments"]}


class HermesFormat(ToolCallFormat):
    """``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, one tag pair per call, text around them."""

    name = "hermes"
    OPEN, CLOSE = "<tool_call>", "</tool_call>"
    _CALL = re.compile(re.escape(OPEN) + r"(.*?)" + re.escape(CLOSE), re.DOTALL)

    def instructions(self) -> str:
        return (f"For each call, write a JSON object with the function's name and arguments inside "
                f"{self.OPEN}{self.CLOSE} tags:\n{self.OPEN}\n{{\"name\": <function-name>, \"arguments\": "
                f"<args-object>}}\n{self.CLOSE}")

    def render(self, calls: list[dict[str, Any]]) -> str:
        return "".join(f"{self.OPEN}\n{json.dumps(self._object(c))}\n{self.CLOSE}" for c in calls)

    def grammar(self, call_schema: dict[str, Any], several: bool) -> str:
        return (f"start: call{'+' if several else ''}\n"
                f"call: {json.dumps(self.OPEN + chr(10))} %json {json.dumps(call_schema)} "
                f"{json.dumps(chr(10) + self.CLOSE)}\n")

    def parse(self, text: str, call_id_prefix: str, final: bool) -> ParsedOutput:
        content: list[str] = []
        calls: list[dict[str, Any]] = []
        position = 0
        for match in self._CALL.finditer(text):
            call = self.call(_json(match.group(1)), call_id_prefix, len(calls))
            content.append(text[position:match.start()] if call is not None else text[position:match.end()])
            if call is not None:
                calls.append(call)
            position = match.end()
        rest = text[position:]
        if not final:
            opened = rest.find(self.OPEN)
            rest = rest[:opened] if opened >= 0 else rest[:len(rest) - _partial(rest, self.OPEN)]
        content.append(rest)
        return ParsedOutput("".join(content), calls)


class MistralFormat(ToolCallFormat):
    """``[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]``: text, then one tag and a JSON array of every call,
    to the end of the output."""

    name = "mistral"
    TAG = "[TOOL_CALLS]"
    keeps_special_tokens = True

    def instructions(self) -> str:
        return (f"To call functions, write {self.TAG} followed by a JSON array of calls, each an object with the "
                f"function's name and arguments: {self.TAG}[{{\"name\": <function-name>, \"arguments\": "
                f"<args-object>}}]")

    def render(self, calls: list[dict[str, Any]]) -> str:
        return self.TAG + json.dumps([self._object(c) for c in calls])

    def grammar(self, call_schema: dict[str, Any], several: bool) -> str:
        array = {"x-guidance": LAYOUT, "type": "array", "items": _without_layout(call_schema), "minItems": 1}
        if not several:
            array["maxItems"] = 1
        return f"start: {json.dumps(self.TAG)} %json {json.dumps(array)}\n"

    def parse(self, text: str, call_id_prefix: str, final: bool) -> ParsedOutput:
        at = text.find(self.TAG)
        if at < 0:
            return ParsedOutput(text if final else text[:len(text) - _partial(text, self.TAG)], [])
        value = _json(text[at + len(self.TAG):])
        calls = [self.call(v, call_id_prefix, i) for i, v in enumerate(value)] if isinstance(value, list) else []
        if calls and all(c is not None for c in calls):
            return ParsedOutput(text[:at], [c for c in calls if c is not None])
        return ParsedOutput(text if final else text[:at], [])  # still forming, or not calls after all


class Llama3JsonFormat(ToolCallFormat):
    """Llama 3.1+'s JSON tool calling: the whole answer is ``{"name": ..., "parameters": {...}}`` (several joined by
    ``; ``), optionally after ``<|python_tag|>``."""

    name = "llama3_json"
    TAG = "<|python_tag|>"
    arguments_key = "parameters"
    keeps_special_tokens = True
    _SEPARATOR = re.compile(r"\s*;\s*")

    def instructions(self) -> str:
        return ('To call a function, answer with only a JSON object in the format {"name": <function-name>, '
                '"parameters": <args-object>}; for several calls, separate the objects with "; ".')

    def render(self, calls: list[dict[str, Any]]) -> str:
        return "; ".join(json.dumps(self._object(c)) for c in calls)

    def grammar(self, call_schema: dict[str, Any], several: bool) -> str:
        repeat = ' ("; " call)*' if several else ""
        return f"start: call{repeat}\ncall: %json {json.dumps(call_schema)}\n"

    def parse(self, text: str, call_id_prefix: str, final: bool) -> ParsedOutput:
        body = text.lstrip()
        body = body[len(self.TAG):].lstrip() if body.startswith(self.TAG) else body
        if not body.startswith("{"):
            forming = not final and (self.TAG.startswith(body) or not body)
            return ParsedOutput("" if forming else text, [])
        calls: list[dict[str, Any]] = []
        decoder, position = json.JSONDecoder(), 0
        while True:
            try:
                value, position = decoder.raw_decode(body, position)
            except json.JSONDecodeError:
                break
            call = self.call(value, call_id_prefix, len(calls))
            if call is None:
                break
            calls.append(call)
            separator = self._SEPARATOR.match(body, position)
            if separator is None or separator.end() == len(body):
                break
            position = separator.end()
        rest = body[position:].strip(" ;\n")
        if calls and (not rest or (not final and rest.startswith("{"))):  # every call, or the next still forming
            return ParsedOutput("", calls)
        return ParsedOutput(text if final else "", [])  # a call still forming, or an answer that is no call


FORMATS: dict[str, ToolCallFormat] = {f.name: f for f in (HermesFormat(), MistralFormat(), Llama3JsonFormat())}
HERMES = FORMATS["hermes"]


def format_for(template: str | None) -> ToolCallFormat:
    """The call format a chat template's model family writes."""
    if template is not None and MistralFormat.TAG in template:
        return FORMATS["mistral"]
    if template is not None and Llama3JsonFormat.TAG in template:
        return FORMATS["llama3_json"]
    return HERMES


def _json(text: str) -> Any:
    """The JSON value ``text`` holds (surrounding whitespace allowed); None when it holds none, or more."""
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return None


def _partial(text: str, tag: str) -> int:
    """Length of the longest end of ``text`` that begins ``tag``."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


def _without_layout(schema: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in schema.items() if k != "x-guidance"}
