"""Chat messages as OpenAI's chat body gives them: each checked (role, content, an assistant's earlier tool calls,
a tool turn's call id) and its content flattened to text, as a chat template takes it."""

from __future__ import annotations

from typing import Any

from rtxcore.errors import InvalidRequestError

# OpenAI's roles ("function" is its older name for "tool"). A role outside them was rendered into the prompt as it
# was: a typo ("usr") went unnoticed.
_ROLES = ("system", "developer", "user", "assistant", "tool", "function")


def parse_message(message: Any, index: int) -> dict[str, Any]:
    """A chat message with its content flattened to text (OpenAI allows a list of ``{"type": "text"}`` parts)."""
    param = f"messages[{index}]"
    if not isinstance(message, dict):
        raise InvalidRequestError(f"{param} must be an object", param="messages")
    role = message.get("role")
    if not isinstance(role, str):
        raise InvalidRequestError(f"{param} lacks a string 'role'", param="messages")
    if role not in _ROLES:
        raise InvalidRequestError(f"{param}.role must be one of {', '.join(_ROLES)}, got {role!r}", param="messages")
    content = message.get("content")
    # Only an assistant's turn may have no content (when it made tool calls).
    if content is None and role != "assistant":
        raise InvalidRequestError(f"{param} ({role}) needs a content", param="messages")
    if role == "tool" and not isinstance(message.get("tool_call_id"), str):
        raise InvalidRequestError(f"{param} (tool) needs the string tool_call_id of the call it answers",
                                  param="messages")
    if isinstance(content, list):
        texts = []
        for part in content:
            if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                raise InvalidRequestError(f"{param}: only text content parts are supported", param="messages")
            texts.append(part["text"])
        content = "".join(texts)
    elif content is None:
        content = ""
    elif not isinstance(content, str):
        raise InvalidRequestError(f"{param}.content must be a string or a list of text parts", param="messages")
    if message.get("tool_calls") is not None:
        _check_tool_calls(message["tool_calls"], f"{param}.tool_calls")
    return {**message, "content": content}


def _check_tool_calls(calls: Any, param: str) -> None:
    """An earlier turn's calls, as OpenAI returned them: ``[{"id", "type": "function", "function": {"name",
    "arguments"}}]``. The arguments are JSON text; an object is taken too (Hugging Face templates' form)."""
    if not isinstance(calls, list):
        raise InvalidRequestError(f"{param} must be a list of tool calls", param="messages")
    for i, call in enumerate(calls):
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise InvalidRequestError(f'{param}[{i}] must be an object with "function": {{"name": string, '
                                      f'"arguments": string}}', param="messages")
        if not isinstance(function.get("arguments", "{}"), str | dict):
            raise InvalidRequestError(f"{param}[{i}].function.arguments must be a JSON string (or an object)",
                                      param="messages")
        if call.get("type", "function") != "function":
            raise InvalidRequestError(f'{param}[{i}].type must be "function"', param="messages")
