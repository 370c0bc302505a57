"""Rendering a model's Jinja chat template the way Hugging Face transformers does.

Chat templates come from model files, so they are untrusted code: they run in Jinja's immutable sandbox. The
environment offers what templates on the Hub rely on: ``raise_exception``, ``strftime_now``, a ``tojson`` that does
not HTML-escape, the ``loopcontrols`` extension, and ``trim_blocks`` / ``lstrip_blocks``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from functools import lru_cache
from typing import Any

import jinja2
import jinja2.ext
import jinja2.utils
from jinja2.sandbox import ImmutableSandboxedEnvironment

from rtxcore.errors import InvalidRequestError

# Used when a model ships no template. Plain text rather than ChatML, because a model without a template has no
# reason to know ChatML's special tokens:
#
#     System: You are terse.
#
#     User: Hi
#
#     Assistant:
DEFAULT_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ message['role'] | capitalize }}: {{ message['content'] }}\n\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}Assistant:{% endif %}"
)


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    # Jinja's own filter HTML-escapes '<' and '>', which would change what the model sees.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class _Namespace(jinja2.utils.Namespace):
    """``namespace()`` that refuses underscore names, so a template cannot reach CPython internals through it."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # same signature trick as Jinja's, so namespace(self=...) works
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _Namespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _Namespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"a chat template cannot set the attribute {name!r}")


@lru_cache(maxsize=16)
def _compile(source: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["namespace"] = _Namespace
    return env.from_string(source)


def check_chat_template(source: str) -> None:
    """Raise ConfigError, naming the problem, when ``source`` is not a Jinja template (``--chat-template``)."""
    from rtxcore.errors import ConfigError

    try:
        _compile(source)
    except jinja2.exceptions.TemplateSyntaxError as exc:
        raise ConfigError(f"the chat template does not parse: {exc.message} (line {exc.lineno})") from None


def _check_messages(messages: Any) -> None:
    if not isinstance(messages, Sequence) or isinstance(messages, (str, bytes)):
        raise InvalidRequestError("messages must be a list of {'role': ..., 'content': ...} objects", param="messages")
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise InvalidRequestError(f"messages[{i}] must be an object, got {type(message).__name__}",
                                      param="messages")
        if not isinstance(message.get("role"), str):
            raise InvalidRequestError(f"messages[{i}] lacks a string 'role'", param="messages")


def render_chat_template(source: str, messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool,
                         special_tokens: Mapping[str, str | None], continue_final_message: bool = False,
                         template_vars: Mapping[str, Any] | None = None) -> str:
    """Render ``source`` for ``messages``.

    :param special_tokens: ``bos_token``, ``eos_token``, ... as the template sees them.
    :param continue_final_message: end the text right after the last message's content, leaving its turn open (what
        the template writes after it, an end-of-turn token, is cut), so that the model continues it.
    :param template_vars: further template variables (``tools``, ``documents``, ``enable_thinking``, ...), by any
        name (a request's chat_template_kwargs: one mapping, not keyword arguments, so that no name can clash with
        a parameter's); they win over ``special_tokens`` as in transformers.
    :raises InvalidRequestError: the template does not compile, rejects the conversation (``raise_exception``), or
        fails while rendering it.
    """
    _check_messages(messages)
    context: dict[str, Any] = {"tools": None, "documents": None, **special_tokens, **(template_vars or {})}
    context["messages"] = [dict(m) for m in messages]
    context["add_generation_prompt"] = add_generation_prompt
    try:
        template = _compile(source)
    except jinja2.TemplateSyntaxError as exc:
        raise InvalidRequestError(f"the model's chat template is invalid (line {exc.lineno}): {exc.message}",
                                  param="messages") from None
    try:
        text = template.render(context)  # one mapping: a variable named "self" is a variable like any other
    except jinja2.TemplateError as exc:
        raise InvalidRequestError(f"chat template rejected the conversation: {exc}", param="messages") from None
    except (TypeError, ValueError, KeyError, IndexError, AttributeError, ArithmeticError, RecursionError) as exc:
        # Templates assume shapes (string content, alternating roles) that a request can break in plain Python ways,
        # and a template of a user's own (--chat-template) can fail in arithmetic ({{ 1 / 0 }}) or recursion.
        raise InvalidRequestError(f"chat template failed on these messages: {type(exc).__name__}: {exc}",
                                  param="messages") from None
    return _open_final_message(text, messages) if continue_final_message else text


def _open_final_message(text: str, messages: Sequence[Mapping[str, Any]]) -> str:
    """``text`` cut after the last message's content. Templates may strip a message's content, so when the content
    as sent does not occur, it is looked for stripped. Its last occurrence is taken, as transformers takes it: a
    content that the template's own closing text also holds (``"end"`` and ``<|im_end|>``) is found there
    instead, a limit shared with transformers' rendering."""
    content = messages[-1].get("content") if messages else None
    if not isinstance(content, str) or not content.strip():
        raise InvalidRequestError("continue_final_message needs a last message with text to continue",
                                  param="messages")
    for wanted in (content, content.strip()):
        at = text.rfind(wanted)
        if at >= 0:
            return text[:at + len(wanted)]
    raise InvalidRequestError("continue_final_message: the chat template does not write the last message's content "
                              "as it was sent, so it cannot be continued", param="messages")
