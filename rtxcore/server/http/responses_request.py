"""OpenAI's Responses API (``POST /v1/responses``) as a chat request: its ``input`` items become chat messages, its
flat function tools chat's nested ones, ``text.format`` a ``response_format``, ``max_output_tokens``
``max_completion_tokens``. The chat path then does the rest (template, tools, grammar, sampling), so both APIs
generate alike; only the response's shape differs (:mod:`rtxcore.server.serving.responses_format`).

Responses are not stored: ``previous_response_id`` and ``background`` are refused, and a client sends the whole
conversation in ``input`` (the Agents SDK's default), as with vLLM's server when its response store is off.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from rtxcore.errors import InvalidRequestError
from rtxcore.server.http.fields import bool_field, int_field
from rtxcore.server.http.structured_fields import json_schema_format

# Fields of a Responses body that have no chat counterpart of the same name, or one that means something else: the
# chat body is built from the rest (sampling fields, vLLM's and rtx-serve's extensions) plus their translations.
_RESPONSES_FIELDS = frozenset({
    "input", "instructions", "max_output_tokens", "text", "tools", "tool_choice", "parallel_tool_calls", "include",
    "top_logprobs", "store", "metadata", "reasoning", "truncation", "previous_response_id", "background",
    "conversation", "prompt", "service_tier", "max_tool_calls", "safety_identifier", "prompt_cache_key",
    "stream_options"})
# Chat fields a Responses body must not pass through under their chat names (it has its own for them, or none).
_CHAT_ONLY_FIELDS = frozenset({"messages", "n", "best_of", "max_tokens", "max_completion_tokens", "response_format",
                               "logprobs", "functions", "function_call", "echo"})
LOGPROBS_INCLUDE = "message.output_text.logprobs"
# Item types of a previous turn a client may send back and that carry nothing for the model here.
_SKIPPED_ITEMS = frozenset({"reasoning"})


@dataclass(slots=True)
class ResponsesRequest:
    # The request as a chat body, for parse_chat.
    chat_body: dict[str, Any]
    # What a response object repeats of its request (instructions, tools, text, ...), as JSON values.
    echo: dict[str, Any]


def parse_responses(body: dict[str, Any]) -> ResponsesRequest:
    """Check a Responses body and translate it; every problem is a 400 naming the Responses field."""
    for name, why in (("previous_response_id", "responses are not stored here: send the whole conversation in "
                       "input"), ("conversation", "conversations are not stored here: send the whole conversation "
                       "in input"), ("prompt", "stored prompt templates are not supported"),
                      ("background", "background responses are not supported")):
        if body.get(name) not in (None, False):
            raise InvalidRequestError(f"{name} is not supported: {why}", param=name)
    truncation = body.get("truncation")
    if truncation not in (None, "disabled"):
        raise InvalidRequestError(f"truncation must be 'disabled' (an input longer than the context is refused), got "
                                  f"{truncation!r}", param="truncation")
    for name in ("store", "parallel_tool_calls"):
        if body.get(name) is not None:
            bool_field(body[name], name)
    metadata = body.get("metadata")
    if metadata is not None and not (isinstance(metadata, dict) and len(metadata) <= 16 and all(
            isinstance(k, str) and len(k) <= 64 and isinstance(v, str) and len(v) <= 512 for k, v in metadata.items())):
        raise InvalidRequestError("metadata must be an object of at most 16 string values (keys of at most 64 "
                                  "characters, values of at most 512)", param="metadata")
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise InvalidRequestError("instructions must be a string", param="instructions")
    messages = ([{"role": "system", "content": instructions}] if instructions else []) + _messages(body.get("input"))
    chat: dict[str, Any] = {k: v for k, v in body.items() if k not in _RESPONSES_FIELDS | _CHAT_ONLY_FIELDS}
    chat["messages"] = messages
    if body.get("max_output_tokens") is not None:
        chat["max_completion_tokens"] = int_field(body["max_output_tokens"], "max_output_tokens", 1)
    response_format = _text_format(body.get("text"))
    if response_format is not None:
        chat["response_format"] = response_format
    tools = _tools(body.get("tools"))
    if tools is not None:
        chat["tools"] = tools
    if body.get("tool_choice") is not None:
        chat["tool_choice"] = _tool_choice(body["tool_choice"])
    if body.get("parallel_tool_calls") is not None:
        chat["parallel_tool_calls"] = body["parallel_tool_calls"]
    if _logprobs_included(body.get("include")):
        chat["logprobs"] = True
        top = body.get("top_logprobs")
        chat["top_logprobs"] = 0 if top is None else top
    elif body.get("top_logprobs") is not None:
        raise InvalidRequestError(f"top_logprobs needs include: [{LOGPROBS_INCLUDE!r}]", param="top_logprobs")
    echo = {"instructions": instructions, "max_output_tokens": body.get("max_output_tokens"),
            "metadata": metadata or {}, "parallel_tool_calls": body.get("parallel_tool_calls", True),
            "store": False, "temperature": body.get("temperature"), "top_p": body.get("top_p"),
            "text": {"format": body["text"]["format"] if response_format is not None else {"type": "text"}},
            "tool_choice": body.get("tool_choice", "auto"),
            "tools": body.get("tools") or [], "truncation": "disabled", "user": body.get("user")}
    return ResponsesRequest(chat, echo)


def _messages(value: Any) -> list[dict[str, Any]]:
    """``input`` as chat messages: a string is one user message; a list holds messages and the function calls and
    their outputs of earlier turns (consecutive calls become one assistant message, as chat templates expect)."""
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if not isinstance(value, list) or not value:
        raise InvalidRequestError("input must be a string or a non-empty list of items", param="input")
    messages: list[dict[str, Any]] = []
    for i, item in enumerate(value):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise InvalidRequestError(f"{where} must be an object", param="input")
        kind = item.get("type", "message")
        if kind == "message":
            messages.append(_message(item, where))
        elif kind == "function_call":
            call = {"id": _string(item, "call_id", where), "type": "function",
                    "function": {"name": _string(item, "name", where), "arguments": _string(item, "arguments", where)}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and last.get("tool_calls") and not last["content"]:
                last["tool_calls"].append(call)
            else:
                messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            if isinstance(output, list):  # a list of content parts: their text
                output = _text_parts(output, f"{where}.output")
            if not isinstance(output, str):
                raise InvalidRequestError(f"{where}.output must be a string", param="input")
            messages.append({"role": "tool", "tool_call_id": _string(item, "call_id", where), "content": output})
        elif kind not in _SKIPPED_ITEMS:
            raise InvalidRequestError(f"{where}.type {kind!r} is not supported (supported: message, function_call, "
                                      "function_call_output, reasoning)", param="input")
    if not any(m["role"] != "system" for m in messages):
        raise InvalidRequestError("input holds no message for the model to answer", param="input")
    return messages


def _message(item: dict[str, Any], where: str) -> dict[str, Any]:
    role = item.get("role")
    if role not in ("user", "assistant", "system", "developer"):
        raise InvalidRequestError(f"{where}.role must be 'user', 'assistant', 'system' or 'developer', got {role!r}",
                                  param="input")
    content = item.get("content")
    if isinstance(content, list):
        content = _text_parts(content, f"{where}.content")
    if not isinstance(content, str):
        raise InvalidRequestError(f"{where}.content must be a string or a list of text parts", param="input")
    # Chat templates know "system"; OpenAI's developer messages are its newer name for them.
    return {"role": "system" if role == "developer" else role, "content": content}


def _text_parts(parts: list[Any], where: str) -> str:
    texts = []
    for j, part in enumerate(parts):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in ("input_text", "output_text", "text") or not isinstance(part.get("text"), str):
            shown = f"type {kind!r}" if kind is not None else "a part that is not a text part"
            raise InvalidRequestError(f"{where}[{j}]: {shown} is not supported: only text parts ({{'type': "
                                      "'input_text', 'text': ...}) are", param="input")
        texts.append(part["text"])
    return "".join(texts)


def _string(item: dict[str, Any], key: str, where: str) -> str:
    value = item.get(key)
    if not isinstance(value, str) or not value:
        raise InvalidRequestError(f"{where}.{key} must be a non-empty string", param="input")
    return value


def _text_format(text: Any) -> dict[str, Any] | None:
    """``text.format`` as chat's ``response_format`` (the same grammar request); None for free text."""
    if text is None:
        return None
    fmt = text.get("format") if isinstance(text, dict) else None
    if not isinstance(text, dict) or (fmt is not None and not isinstance(fmt, dict)):
        raise InvalidRequestError("text must be an object like {'format': {'type': 'text'}}", param="text")
    kind = (fmt or {}).get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind == "json_schema":
        assert fmt is not None
        json_schema_format(fmt, "text.format", "text.format")  # checked here, to name the Responses field
        return {"type": "json_schema", "json_schema": {k: fmt[k] for k in ("name", "schema", "strict") if k in fmt}}
    raise InvalidRequestError(f"text.format.type must be 'text', 'json_object' or 'json_schema', got {kind!r}",
                              param="text.format")


def _tools(tools: Any) -> list[dict[str, Any]] | None:
    """Responses' flat function tools (``{"type": "function", "name", "parameters", ...}``) in chat's form."""
    if tools is None or tools == []:
        return None
    if not isinstance(tools, list):
        raise InvalidRequestError("tools must be a list of function tools", param="tools")
    nested = []
    for i, tool in enumerate(tools):
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind != "function":
            raise InvalidRequestError(f"tools[{i}].type {kind!r} is not supported: only function tools "
                                      "({'type': 'function', 'name': ..., 'parameters': {...}}) are", param="tools")
        function = {k: tool[k] for k in ("name", "description", "parameters") if tool.get(k) is not None}
        nested.append({"type": "function", "function": function})
    return nested


def _tool_choice(choice: Any) -> Any:
    if isinstance(choice, dict):
        if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
            raise InvalidRequestError("tool_choice must be 'auto', 'none', 'required' or {'type': 'function', "
                                      "'name': ...}", param="tool_choice")
        return {"type": "function", "function": {"name": choice["name"]}}
    return choice  # a string: chat's check names what is wrong


def _logprobs_included(include: Any) -> bool:
    if include is None:
        return False
    if not isinstance(include, list) or not all(isinstance(x, str) for x in include):
        raise InvalidRequestError("include must be a list of strings", param="include")
    unknown = sorted(set(include) - {LOGPROBS_INCLUDE})
    if unknown:
        raise InvalidRequestError(f"include {unknown[0]!r} is not supported (supported: {LOGPROBS_INCLUDE!r})",
                                  param="include")
    return LOGPROBS_INCLUDE in include
