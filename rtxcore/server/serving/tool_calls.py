"""Tool calling: OpenAI's ``tools`` and ``tool_choice`` turned into a prompt the model understands, a grammar when a
call is required, and the model's text turned back into ``tool_calls``.

A model whose chat template knows tools gets them through the template's ``tools`` variable; any other gets them
described in its system message. How calls are written (Hermes' tags, Mistral's ``[TOOL_CALLS]``, Llama's JSON) is
the format its template's family uses (rtxcore.server.serving.tool_formats).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from rtxcore.errors import InvalidRequestError
from rtxcore.server.serving.json_schema import closed_objects
from rtxcore.server.serving.tool_formats import FORMATS, HERMES, LAYOUT, ParsedOutput, ToolCallFormat

_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")


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


def tool_messages(messages: list[dict[str, Any]], request: ToolRequest, template: str | None,
                  fmt: ToolCallFormat = HERMES) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The messages to render and the template's extra variables: the tools through the template's own ``tools``
    variable where it has one, else described in the system message. Earlier calls (an assistant's ``tool_calls``)
    go to a template that knows tools as it expects them (arguments as objects), to any other written as the model
    would have written them."""
    if template_knows_tools(template):
        rendered = [_with_call_objects(m) for m in messages]
        return rendered, {"tools": [{"type": "function", "function": t} for t in request.tools]}
    rendered = [_with_calls_as_text(m, fmt) for m in messages]
    described = _tool_instructions(request, fmt)
    if rendered and rendered[0].get("role") == "system":
        rendered[0] = {**rendered[0], "content": f"{rendered[0]['content']}\n\n{described}"}
    else:
        rendered.insert(0, {"role": "system", "content": described})
    return rendered, {}


def _with_calls_as_text(message: dict[str, Any], fmt: ToolCallFormat) -> dict[str, Any]:
    calls = message.get("tool_calls")
    if message.get("role") != "assistant" or not isinstance(calls, list):
        return message
    text = fmt.render([_call_of(c) for c in calls])
    return {**message, "content": (message.get("content") or "") + text}


def _with_call_objects(message: dict[str, Any]) -> dict[str, Any]:
    """Hugging Face templates read ``tool_calls[i].function.arguments`` as an object; OpenAI sends JSON text."""
    calls = message.get("tool_calls")
    if message.get("role") != "assistant" or not isinstance(calls, list):
        return message
    objects = [{**c, "function": {**c.get("function", {}), "arguments": _call_of(c)["arguments"]}}
               if isinstance(c, dict) else c for c in calls]
    return {**message, "tool_calls": objects}


def _call_of(call: Any) -> dict[str, Any]:
    function = call.get("function", {}) if isinstance(call, dict) else {}
    arguments = function.get("arguments", "{}")
    try:
        arguments = json.loads(arguments) if isinstance(arguments, str) else arguments
    except json.JSONDecodeError:
        pass
    return {"name": function.get("name"), "arguments": arguments}


def _tool_instructions(request: ToolRequest, fmt: ToolCallFormat) -> str:
    signatures = "\n".join(json.dumps({"type": "function", "function": t}) for t in request.tools)
    if request.choice == "none":
        return (f"You have access to these functions:\n<tools>\n{signatures}\n</tools>\nDo not call any of them "
                "now: answer in text.")
    must = {"auto": "You may call one or more of these functions when they help answer.",
            "required": "You must call at least one of these functions."}.get(
        request.choice, f"You must call the function {request.choice}.")
    return f"You have access to these functions:\n<tools>\n{signatures}\n</tools>\n{must} {fmt.instructions()}"


# -- the grammar -----------------------------------------------------------------------------------------------------


def required_grammar(request: ToolRequest, fmt: ToolCallFormat = HERMES) -> str | None:
    """A grammar holding the output to calls in ``fmt``, when the request requires one (``required`` or a named
    function); None when the model may answer in text."""
    if request.choice in ("auto", "none"):
        return None
    tools = request.tools if request.choice == "required" else [t for t in request.tools if t["name"] ==
                                                                  request.choice]
    # Arguments as OpenAI's strict function calling has them: only the listed properties (a small model otherwise
    # invents more until max_tokens cuts the call).
    options = [{"type": "object", "properties": {"name": {"const": t["name"]},
                                                 fmt.arguments_key: closed_objects(t["parameters"])},
                "required": ["name", fmt.arguments_key], "additionalProperties": False} for t in tools]
    schema = {"x-guidance": LAYOUT, **(options[0] if len(options) == 1 else {"anyOf": options})}
    # A named function is one call of it (as vLLM and OpenAI force it); "required" may make several when parallel.
    return fmt.grammar(schema, several=request.parallel and request.choice == "required")


def parse_output(text: str, call_id_prefix: str, final: bool, fmt: str = HERMES.name) -> ParsedOutput:
    """Split the model's text into content and calls in the format named ``fmt``: a call that does not parse stays
    content; while the output is not final, what may still become a call is held back."""
    return FORMATS[fmt].parse(text, call_id_prefix, final)
