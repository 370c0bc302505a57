"""vLLM's chat-body fields that steer the chat template: ``add_generation_prompt``, ``continue_final_message`` and
``chat_template_kwargs`` (extra template variables such as Qwen3's ``enable_thinking``).

Chat completions and ``/tokenize`` read them alike, so that a count from ``/tokenize`` is the prompt a completion of
the same body gets.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from rtxcore.errors import InvalidRequestError
from rtxcore.server.http.fields import bool_field

# Template variables that fields of the chat body set: a template kwarg of the same name would silently fight them.
_RESERVED_VARIABLES = ("messages", "add_generation_prompt", "continue_final_message", "tools")


@dataclass(slots=True, frozen=True)
class ChatTemplateFields:
    # Open the assistant's turn after the messages (the default), so the model answers.
    add_generation_prompt: bool = True
    # Leave the last message (the assistant's, usually) open, so the model continues its text rather than starting a
    # new turn. Exclusive with add_generation_prompt.
    continue_final_message: bool = False
    # Further variables for the template, by the names it reads.
    template_vars: dict[str, Any] = field(default_factory=dict)


def parse_chat_template_fields(body: dict[str, Any]) -> ChatTemplateFields:
    """:raises InvalidRequestError: naming the field at fault."""
    if body.get("chat_template") is not None:
        # vLLM too refuses a template sent with the request unless told to trust it: a template is code.
        raise InvalidRequestError("a chat template cannot be sent with a request; the server's is the model's own or "
                                  "rtx serve --chat-template FILE", param="chat_template")
    continue_final = body.get("continue_final_message")
    continue_final = False if continue_final is None else bool_field(continue_final, "continue_final_message")
    add_prompt = body.get("add_generation_prompt")
    # Given alone, continue_final_message implies add_generation_prompt false; both true cannot be rendered.
    add_prompt = not continue_final if add_prompt is None else bool_field(add_prompt, "add_generation_prompt")
    if add_prompt and continue_final:
        raise InvalidRequestError("continue_final_message and add_generation_prompt cannot both be true: the last "
                                  "message is either continued or answered", param="continue_final_message")
    template_vars = body.get("chat_template_kwargs")
    if template_vars is None:
        template_vars = {}
    if not isinstance(template_vars, dict):
        raise InvalidRequestError("chat_template_kwargs must be an object of template variables",
                                  param="chat_template_kwargs")
    reserved = [name for name in _RESERVED_VARIABLES if name in template_vars]
    if reserved:
        raise InvalidRequestError(f"chat_template_kwargs cannot set {reserved[0]!r}: use the body's {reserved[0]} "
                                  "field", param="chat_template_kwargs")
    return ChatTemplateFields(add_prompt, continue_final, dict(template_vars))
