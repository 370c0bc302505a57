"""Tool calling: OpenAI's ``tools`` and ``tool_choice`` turned into a prompt the model understands, a grammar when a
call is required, and the model's text turned back into ``tool_calls``.

One call format today, Hermes' (``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``), which Qwen 2.5,
Hermes and SmolLM3 templates write; a model whose chat template knows tools gets them through the template's
``tools`` variable, any other gets them described in its system message in that format. Parsing is a pure function
of the text so far, so a stream resumed after a restart emits exactly the deltas it would have emitted.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from rtxcore.errors import InvalidRequestError
from rtxcore.server.serving.json_schema import closed_objects

OPEN, CLOSE = "<tool_call>", "</tool_call>"
# The format's name in a journaled ResponseSpec.
HERMES = "hermes"
_CALL = re.compile(re.escape(OPEN) + r"(.*?)" + re.escape(CLOSE), re.DOTALL)
_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
# JSON as small models should write it (see rtx_plugins.logits_processors.structured_output).
_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


@dataclass(slots=True, frozen=True)
class ToolRequest:
    tools: list[dict[str, Any]]
    # "auto", "none", "required", or a function's name.
    choice: str
    parallel: bool

    @property
    def active(self) -> bool:
        return bool(self.tools) and self.choice != "none"


def parse_tools(body: dict[str, Any]) -> ToolRequest | None:
    """``tools``, ``tool_choice`` and ``parallel_tool_calls`` of a chat body, checked; None without tools."""
    tools = body.get("tools")
    choice = body.get("tool_choice")
    if tools is None:
        if choice not in (None, "none"):
            raise InvalidRequestError("tool_choice needs tools", param="tool_choice")
        return None
    if not isinstance(tools, list) or not tools:
        raise InvalidRequestError("tools must be a non-empty list of {'type': 'function', 'function': {...}}",
                                  param="tools")
    checked = [_tool(tool, i) for i, tool in enumerate(tools)]
    names = [t["name"] for t in checked]
    if len(set(names)) != len(names):
        raise InvalidRequestError("tools: function names must be unique", param="tools")
    if choice is None:
        choice = "auto"
    elif isinstance(choice, dict):
        function = choice.get("function") if choice.get("type") == "function" else None
        name = function.get("name") if isinstance(function, dict) else None
        if not isinstance(name, str) or name not in names:
            raise InvalidRequestError(f"tool_choice names a function that is not among the tools: {name!r}",
                                      param="tool_choice")
        choice = name
    elif choice not in ("auto", "none", "required"):
        raise InvalidRequestError("tool_choice must be 'auto', 'none', 'required' or "
                                  "{'type': 'function', 'function': {'name': ...}}", param="tool_choice")
    parallel = body.get("parallel_tool_calls", True)
    if not isinstance(parallel, bool):
        raise InvalidRequestError("parallel_tool_calls must be true or false", param="parallel_tool_calls")
    return ToolRequest(checked, choice, parallel)


def _tool(tool: Any, index: int) -> dict[str, Any]:
    function = tool.get("function") if isinstance(tool, dict) and tool.get("type") == "function" else None
    if not isinstance(function, dict):
        raise InvalidRequestError(f"tools[{index}] must be {{'type': 'function', 'function': {{...}}}}", param="tools")
    name = function.get("name")
    if not isinstance(name, str) or not _NAME.match(name):
        raise InvalidRequestError(f"tools[{index}].function.name must be 1-64 letters, digits, '_', '.' or '-'",
                                  param="tools")
    parameters = function.get("parameters", {"type": "object", "properties": {}})
    if not isinstance(parameters, dict):
        raise InvalidRequestError(f"tools[{index}].function.parameters must be a JSON Schema object", param="tools")
    description = function.get("description") or ""
    if not isinstance(description, str):
        raise InvalidRequestError(f"tools[{index}].function.description must be a string", param="tools")
    return {"name": name, "description": description, "parameters": parameters}


# -- the prompt ------------------------------------------------------------------------------------------------------


def template_knows_tools(template: str | None) -> bool:
    return template is not None and "tools" in template


def tool_messages(messages: list[dict[str, Any]], request: ToolRequest, template: str | None
                  ) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The messages to render and the template's extra variables: the tools through the template's own ``tools``
    variable where it has one, else described in the system message. Earlier calls (an assistant's ``tool_calls``)
    are written back in the call format, so the model sees what it did."""
    rendered = [_with_calls_as_text(m) for m in messages]
    if template_knows_tools(template):
        return rendered, {"tools": [{"type": "function", "function": t} for t in request.tools]}
    described = _tool_instructions(request)
    if rendered and rendered[0].get("role") == "system":
        rendered[0] = {**rendered[0], "content": f"{rendered[0]['content']}\n\n{described}"}
    else:
        rendered.insert(0, {"role": "system", "content": described})
    return rendered, {}


def _with_calls_as_text(message: dict[str, Any]) -> dict[str, Any]:
    calls = message.get("tool_calls")
    if message.get("role") != "assistant" or not isinstance(calls, list):
        return message
    text = "".join(f"{OPEN}\n{json.dumps(_call_of(c))}\n{CLOSE}" for c in calls)
    return {**message, "content": (message.get("content") or "") + text}


def _call_of(call: Any) -> dict[str, Any]:
    function = call.get("function", {}) if isinstance(call, dict) else {}
    arguments = function.get("arguments", "{}")
    try:
        arguments = json.loads(arguments) if isinstance(arguments, str) else arguments
    except json.JSONDecodeError:
        pass
    return {"name": function.get("name"), "arguments": arguments}


def _tool_instructions(request: ToolRequest) -> str:
    signatures = "\n".join(json.dumps({"type": "function", "function": t}) for t in request.tools)
    must = {"auto": "You may call one or more of these functions when they help answer.",
            "required": "You must call at least one of these functions."}.get(
        request.choice, f"You must call the function {request.choice}.")
    return (f"You have access to these functions:\n<tools>\n{signatures}\n</tools>\n{must} "
            f"For each call, write a JSON object with the function's name and arguments inside "
            f"{OPEN}{CLOSE} tags:\n{OPEN}\n{{\"name\": <function-name>, \"arguments\": <args-object>}}\n{CLOSE}")


# -- the grammar -----------------------------------------------------------------------------------------------------


def required_grammar(request: ToolRequest) -> str | None:
    """A Lark grammar (llguidance's dialect, JSON Schema embedded with ``%json``) holding the output to calls, when
    the request requires one (``required`` or a named function); None when the model may answer in text."""
    if request.choice in ("auto", "none"):
        return None
    tools = request.tools if request.choice == "required" else [t for t in request.tools if t["name"] ==
                                                                  request.choice]
    # Arguments as OpenAI's strict function calling has them: only the listed properties (a small model otherwise
    # invents more until max_tokens cuts the call).
    options = [{"type": "object", "properties": {"name": {"const": t["name"]},
                                                 "arguments": closed_objects(t["parameters"])},
                "required": ["name", "arguments"], "additionalProperties": False} for t in tools]
    schema = {"x-guidance": _LAYOUT, **(options[0] if len(options) == 1 else {"anyOf": options})}
    # A named function is one call of it (as vLLM and OpenAI force it); "required" may make several when parallel.
    repeat = "+" if request.parallel and request.choice == "required" else ""
    return (f"start: call{repeat}\n"
            f"call: {json.dumps(OPEN + chr(10))} %json {json.dumps(schema)} {json.dumps(chr(10) + CLOSE)}\n")


# -- the output ------------------------------------------------------------------------------------------------------


@dataclass(slots=True, frozen=True)
class ParsedOutput:
    # Text outside complete calls, less what may still become a call (unless the output is final).
    content: str
    calls: list[dict[str, Any]]


def parse_output(text: str, call_id_prefix: str, final: bool) -> ParsedOutput:
    """Split the model's text into content and calls. A call whose JSON does not parse stays content; while the
    output is not final, an opened call and a trailing prefix of the opening tag are held back."""
    content: list[str] = []
    calls: list[dict[str, Any]] = []
    position = 0
    for match in _CALL.finditer(text):
        call = _decoded(match.group(1))
        content.append(text[position:match.start()] if call is not None else text[position:match.end()])
        if call is not None:
            calls.append({"id": f"{call_id_prefix}-{len(calls)}", "type": "function",
                          "function": {"name": call[0], "arguments": call[1]}})
        position = match.end()
    rest = text[position:]
    if not final:
        opened = rest.find(OPEN)
        if opened >= 0:
            rest = rest[:opened]
        else:
            rest = rest[:len(rest) - _partial_tag(rest)]
    content.append(rest)
    return ParsedOutput("".join(content), calls)


def _decoded(body: str) -> tuple[str, str] | None:
    try:
        value = json.loads(body)
    except json.JSONDecodeError:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments = value.get("arguments", value.get("parameters", {}))
    return value["name"], json.dumps(arguments, ensure_ascii=False)


def _partial_tag(text: str) -> int:
    """Length of the longest end of ``text`` that begins the opening tag."""
    for n in range(min(len(OPEN) - 1, len(text)), 0, -1):
        if OPEN.startswith(text[-n:]):
            return n
    return 0
