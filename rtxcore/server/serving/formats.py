"""How a generation's outputs become response bodies and stream events, for each kind of request: OpenAI's
completions and chat, the native ``/generate``, and gRPC's ``GenerateResponse`` fields.

A format is rebuilt from its :class:`ResponseSpec` alone (which the journal records), so that a request resumed after
a restart goes on producing exactly the events it would have produced without one. Events are plain JSON values;
the protocol adapters only frame them (SSE for HTTP, messages for gRPC).
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from rtxcore.engine.outputs import RequestOutput, TokenLogprob
from rtxcore.errors import ErrorCode, RequestError
from rtxcore.server.serving.generation import Choice, Generation
from rtxcore.server.serving.tool_calls import parse_output
from rtxcore.tokenizer import Tokenizer

# OpenAI's error ``type`` for each code, and the ``code`` field when the error names no reason of its own.
_OPENAI_TYPES = {
    ErrorCode.INVALID_ARGUMENT: "invalid_request_error",
    ErrorCode.UNAUTHENTICATED: "authentication_error",
    ErrorCode.PERMISSION_DENIED: "permission_error",
    ErrorCode.NOT_FOUND: "not_found_error",
    ErrorCode.CONFLICT: "invalid_request_error",
    ErrorCode.FAILED_PRECONDITION: "invalid_request_error",
    ErrorCode.OUT_OF_RANGE: "invalid_request_error",
    ErrorCode.RESOURCE_EXHAUSTED: "rate_limit_error",
    ErrorCode.UNAVAILABLE: "service_unavailable_error",
    ErrorCode.DEADLINE_EXCEEDED: "timeout_error",
    ErrorCode.CANCELLED: "invalid_request_error",
    ErrorCode.INTERNAL: "server_error",
}
_OPENAI_CODES = {
    ErrorCode.UNAUTHENTICATED: "invalid_api_key",
    ErrorCode.PERMISSION_DENIED: "not_entitled",
    ErrorCode.NOT_FOUND: "not_found",
    ErrorCode.RESOURCE_EXHAUSTED: "server_overloaded",
    ErrorCode.UNAVAILABLE: "not_ready",
    ErrorCode.DEADLINE_EXCEEDED: "timeout",
    ErrorCode.CANCELLED: "cancelled",
    ErrorCode.INTERNAL: "internal_error",
}


# Line breaks to str.splitlines() (and so to httpx's aiter_lines) that JSON leaves raw: generated text can hold them,
# and a client splitting lines that way would get half an event.
_LINE_BREAKS = str.maketrans({"\x85": "\\u0085", "\u2028": "\\u2028", "\u2029": "\\u2029"})


def event_text(payload: Any) -> str:
    """An event as it is stored, journaled and sent: JSON on one line for every line splitter (JSON escapes newlines
    and control characters; the Unicode line separators it leaves raw are escaped here)."""
    return json.dumps(payload, ensure_ascii=False, separators=(",", ":")).translate(_LINE_BREAKS)


def openai_error_body(err: RequestError) -> dict[str, Any]:
    """``{"error": {"message", "type", "param", "code"}}``, the shape OpenAI's clients parse."""
    return {"error": {"message": err.message, "type": _OPENAI_TYPES[err.code], "param": err.param,
                      "code": err.reason or _OPENAI_CODES.get(err.code)}}


def token_text(tokenizer: Tokenizer | None, token_id: int) -> str:
    """How a token reads in logprobs; ``token_id:N`` for models without a tokenizer (as vLLM spells it)."""
    if tokenizer is None:
        return f"token_id:{token_id}"
    return tokenizer.decode([token_id], skip_special_tokens=False)


def native_logprobs(logprobs: list[TokenLogprob]) -> list[dict[str, Any]]:
    return [{"token_id": lp.token_id, "logprob": lp.logprob, "top": [[t, p] for t, p in lp.top]} for lp in logprobs]


@dataclass(slots=True)
class ResponseSpec:
    """What a response looks like beyond the outputs: everything its format needs, as plain JSON values."""

    # "completion", "chat", "responses", "native" or "grpc" (a key of FORMATS).
    kind: str
    stream: bool
    # The fields every body and chunk starts with (OpenAI: id, object, created, model; native: id, model).
    header: dict[str, Any] = field(default_factory=dict)
    include_usage: bool = False
    # Whether the request asked for logprobs (and so every chunk carries a logprobs field).
    logprobs: bool = False
    # The tool-call format the chat output is parsed with (rtxcore.server.serving.tool_calls), None without tools.
    tools: str | None = None
    # Choices returned per prompt, and sampled per prompt (more than n: the n most likely are returned).
    n: int = 1
    best_of: int = 1
    # Completions' echo: per prompt, {"text": the prompt's text, "logprobs": per prompt token [token_id, logprob,
    # [[token_id, logprob], ...]], null for the first, or null when logprobs were not asked for}; None without echo.
    echo: list[dict[str, Any]] | None = None
    # Responses: what the response object repeats of its request (instructions, tools, text, ...).
    request: dict[str, Any] | None = None
    # The request's own names of engine parameters, for errors that arise while it runs (a grammar the grammar
    # engine gives up on mid-way is the request's "structured_output", sent as "response_format" or "guided_regex").
    param_names: dict[str, str] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> ResponseSpec:
        return cls(**data)


@dataclass(slots=True, frozen=True)
class PromptToken:
    """A prompt's first token in echoed logprobs: nothing before it predicts it, so it has no log-probability."""

    token_id: int


class ResponseFormat(ABC):
    # Whether a stream ends with ``data: [DONE]`` after its events.
    ends_with_done = True
    # Whether each event carries its place in the stream (``sequence_number``, from 0), set as it is sent.
    numbered_events = False

    def __init__(self, spec: ResponseSpec, tokenizer: Tokenizer | None):
        self.spec = spec
        self.tokenizer = tokenizer

    def opening(self) -> list[dict[str, Any]]:
        """Events sent before any output."""
        return []

    @abstractmethod
    def events(self, gen: Generation, choice: Choice, out: RequestOutput) -> list[dict[str, Any]]:
        """The events for one output (``choice`` already holds it); none when it carries nothing to send."""

    def closing(self, gen: Generation) -> list[dict[str, Any]]:
        """Events sent after the last output (before ``[DONE]``)."""
        return []

    @abstractmethod
    def body(self, gen: Generation) -> dict[str, Any]:
        """The whole response of a non-streaming request."""

    def error_event(self, err: RequestError) -> dict[str, Any]:
        """The last event of a stream that failed."""
        return openai_error_body(err)

    def error_body(self, err: RequestError) -> dict[str, Any]:
        """The response of a non-streaming request that failed."""
        return openai_error_body(err)


class ChunkFormat(ResponseFormat):
    """A format of at most one event per output, its chunk."""

    def events(self, gen: Generation, choice: Choice, out: RequestOutput) -> list[dict[str, Any]]:
        event = self.chunk(gen, choice, out)
        return [] if event is None else [event]

    @abstractmethod
    def chunk(self, gen: Generation, choice: Choice, out: RequestOutput) -> dict[str, Any] | None:
        """The event for one output, or None when it carries nothing to send."""


class CompletionFormat(ChunkFormat):
    def opening(self) -> list[dict[str, Any]]:
        """With echo, each choice's prompt, before any of its output."""
        if self.spec.echo is None:
            return []
        parts = []
        for index in range(len(self.spec.echo) * self.spec.n):
            echo = self.spec.echo[index // self.spec.n]
            parts.append({"index": index, "text": echo["text"],
                          "logprobs": self._logprobs(self._echo_logprobs(echo), 0), "finish_reason": None})
        return [{**self.spec.header, "choices": parts, **self._null_usage()}]

    def chunk(self, gen: Generation, choice: Choice, out: RequestOutput) -> dict[str, Any] | None:
        if not (out.new_text or out.finished or out.logprobs):
            return None
        offset = len(self._echo_text(choice.index)) + len(choice.text) - len(out.new_text)
        part = {"index": choice.index, "text": out.new_text, "logprobs": self._logprobs(out.logprobs or [], offset),
                "finish_reason": out.finish_reason}
        return {**self.spec.header, "choices": [part], **self._null_usage()}

    def closing(self, gen: Generation) -> list[dict[str, Any]]:
        return [{**self.spec.header, "choices": [], "usage": gen.usage()}] if self.spec.include_usage else []

    def body(self, gen: Generation) -> dict[str, Any]:
        choices = []
        for index, c in enumerate(self._returned(gen.choices)):
            echo = self.spec.echo[c.index // self.spec.best_of] if self.spec.echo is not None else None
            prefix = echo["text"] if echo is not None else ""
            logprobs = [*self._echo_logprobs(echo), *c.logprobs] if echo is not None else c.logprobs
            choices.append({"index": index, "text": prefix + c.text, "logprobs": self._logprobs(logprobs, 0),
                            "finish_reason": c.finish_reason})
        return {**self.spec.header, "choices": choices, "usage": gen.usage()}

    def _returned(self, choices: list[Choice]) -> list[Choice]:
        """The choices a body returns: all, or with best_of, the n of each prompt's with the highest cumulative
        log-probability (ties keep their order), as OpenAI's legacy completions rank them."""
        n, best_of = self.spec.n, self.spec.best_of
        if best_of == n:
            return choices
        kept: list[Choice] = []
        for start in range(0, len(choices), best_of):
            group = choices[start:start + best_of]
            kept += sorted(group, key=lambda c: -sum(lp.logprob for lp in c.logprobs))[:n]
        return kept

    def _echo_text(self, index: int) -> str:
        return self.spec.echo[index // self.spec.n]["text"] if self.spec.echo is not None else ""

    @staticmethod
    def _echo_logprobs(echo: dict[str, Any] | None) -> list[TokenLogprob | PromptToken]:
        if echo is None or echo["logprobs"] is None:
            return []
        return [PromptToken(lp[0]) if lp[1] is None else TokenLogprob(lp[0], lp[1], [(t, p) for t, p in lp[2]])
                for lp in echo["logprobs"]]

    def _null_usage(self) -> dict[str, Any]:
        return {"usage": None} if self.spec.include_usage else {}

    def _logprobs(self, lps: Sequence[TokenLogprob | PromptToken], offset: int) -> dict[str, Any] | None:
        """OpenAI's legacy logprobs object."""
        if not self.spec.logprobs:
            return None
        tokens: list[str] = []
        token_logprobs: list[float | None] = []
        top_logprobs: list[dict[str, float] | None] = []
        offsets: list[int] = []
        for lp in lps:
            token = token_text(self.tokenizer, lp.token_id)
            tokens.append(token)
            if isinstance(lp, TokenLogprob):
                token_logprobs.append(lp.logprob)
                top = {token_text(self.tokenizer, t): p for t, p in lp.top}
                # The sampled token is always among them, as in OpenAI's and vLLM's: up to logprobs + 1 entries.
                top.setdefault(token, lp.logprob)
                top_logprobs.append(top)
            else:
                token_logprobs.append(None)
                top_logprobs.append(None)
            offsets.append(offset)
            offset += len(token)
        return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs,
                "text_offset": offsets}


class ChatFormat(CompletionFormat):
    def opening(self) -> list[dict[str, Any]]:
        firsts = [{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
                  for i in range(self.spec.n)]
        return [{**self.spec.header, "choices": firsts, **self._null_usage()}]

    def chunk(self, gen: Generation, choice: Choice, out: RequestOutput) -> dict[str, Any] | None:
        if not (out.new_text or out.finished or out.logprobs):
            return None
        finish_reason = out.finish_reason
        if self.spec.tools is None:
            delta: dict[str, Any] = {"content": out.new_text} if out.new_text else {}
        else:
            delta, called = self._tool_delta(gen, choice, out)
            if out.finished and called and finish_reason == "stop":
                finish_reason = "tool_calls"
            if not (delta or out.finished or out.logprobs):
                return None
        part = {"index": choice.index, "delta": delta, "logprobs": self._chat_logprobs(out.logprobs or []),
                "finish_reason": finish_reason}
        return {**self.spec.header, "choices": [part], **self._null_usage()}

    def _tool_delta(self, gen: Generation, choice: Choice, out: RequestOutput) -> tuple[dict[str, Any], bool]:
        """What this output adds to the content and to the calls, from the text before and after it (a pure
        function of the text: a resumed stream repeats it exactly); and whether the output holds any call."""
        prefix = _call_prefix(gen, choice)
        call_format = self.spec.tools or ""  # set: only requests with tools come here
        before = parse_output(choice.text[:len(choice.text) - len(out.new_text)], prefix, False, call_format)
        after = parse_output(choice.text, prefix, out.finished, call_format)
        delta: dict[str, Any] = {}
        if len(after.content) > len(before.content):
            delta["content"] = after.content[len(before.content):]
        new_calls = after.calls[len(before.calls):]
        if new_calls:
            delta["tool_calls"] = [{"index": len(before.calls) + i, **call} for i, call in enumerate(new_calls)]
        return delta, bool(after.calls)

    def body(self, gen: Generation) -> dict[str, Any]:
        return {**self.spec.header, "choices": [self._message(gen, c) for c in gen.choices], "usage": gen.usage()}

    def _message(self, gen: Generation, choice: Choice) -> dict[str, Any]:
        message: dict[str, Any] = {"role": "assistant", "content": choice.text}
        finish_reason = choice.finish_reason
        if self.spec.tools is not None:
            parsed = parse_output(choice.text, _call_prefix(gen, choice), True, self.spec.tools)
            if parsed.calls:
                message = {"role": "assistant", "content": parsed.content.strip() or None,
                           "tool_calls": parsed.calls}
                finish_reason = "tool_calls" if finish_reason == "stop" else finish_reason
        return {"index": choice.index, "message": message, "logprobs": self._chat_logprobs(choice.logprobs),
                "finish_reason": finish_reason}

    def _chat_logprobs(self, lps: list[TokenLogprob]) -> dict[str, Any] | None:
        return {"content": chat_logprobs(self.tokenizer, lps)} if self.spec.logprobs else None


def chat_logprobs(tokenizer: Tokenizer | None, lps: list[TokenLogprob]) -> list[dict[str, Any]]:
    """Each token as OpenAI's chat and Responses APIs list it: ``{"token", "logprob", "bytes", "top_logprobs"}``."""

    def entry(token_id: int, logprob: float) -> dict[str, Any]:
        token = token_text(tokenizer, token_id)
        return {"token": token, "logprob": logprob, "bytes": list(token.encode())}

    return [{**entry(lp.token_id, lp.logprob), "top_logprobs": [entry(t, p) for t, p in lp.top]} for lp in lps]


def _call_prefix(gen: Generation, choice: Choice) -> str:
    """Tool-call ids start with it: unique per request, and per choice when there are several."""
    return f"call_{gen.req_id}" if choice.index == 0 else f"call_{gen.req_id}_{choice.index}"


class NativeFormat(ChunkFormat):
    """``/generate``: one event per engine output, ``{"text", "token_ids", "finished", ...}``; the last one has the
    usage."""

    ends_with_done = False

    def chunk(self, gen: Generation, choice: Choice, out: RequestOutput) -> dict[str, Any] | None:
        event: dict[str, Any] = {"text": out.new_text, "token_ids": out.new_token_ids, "finished": out.finished}
        if out.logprobs is not None:
            event["logprobs"] = native_logprobs(out.logprobs)
        if out.finished:
            event.update(finish_reason=out.finish_reason, usage=gen.usage())
        return event

    def body(self, gen: Generation) -> dict[str, Any]:
        choice = gen.choices[0]
        return {**self.spec.header, "text": choice.text, "num_tokens": choice.num_tokens,
                "finish_reason": choice.finish_reason,
                "logprobs": native_logprobs(choice.logprobs) if self.spec.logprobs else None, "usage": gen.usage()}


class GrpcFormat(ChunkFormat):
    """gRPC ``Generate``: each event holds one ``GenerateResponse``'s fields (the servicer builds the message from
    it), so a gRPC request is produced, journaled, replayed and resumed like an HTTP one. Always a stream; an error
    event carries the error's code, which the servicer maps to a status."""

    ends_with_done = False

    def chunk(self, gen: Generation, choice: Choice, out: RequestOutput) -> dict[str, Any] | None:
        # Usage from the choice: a request resumed after a restart counts its earlier output once.
        return {"text": out.new_text, "token_ids": out.new_token_ids, "finished": out.finished,
                "finish_reason": out.finish_reason or "",
                "usage": {"prompt_tokens": choice.num_prompt_tokens, "completion_tokens": choice.num_tokens,
                          "cached_tokens": choice.num_cached_tokens},
                "logprobs": native_logprobs(out.logprobs or [])}

    def body(self, gen: Generation) -> dict[str, Any]:
        raise TypeError("gRPC responses are always streamed")

    def error_event(self, err: RequestError) -> dict[str, Any]:
        return {"error": err.to_json()}


FORMATS: dict[str, type[ResponseFormat]] = {"completion": CompletionFormat, "chat": ChatFormat,
                                            "native": NativeFormat, "grpc": GrpcFormat}


def _register_responses() -> None:
    # The Responses format builds on this module's base class, so it is imported once that exists.
    from rtxcore.server.serving.responses_format import ResponsesFormat

    FORMATS["responses"] = ResponsesFormat


_register_responses()


def make_format(spec: ResponseSpec, tokenizer: Tokenizer | None) -> ResponseFormat:
    return FORMATS[spec.kind](spec, tokenizer)
