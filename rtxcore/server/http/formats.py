"""How a generation's outputs become response bodies and SSE events, for each kind of request.

A format is rebuilt from its :class:`ResponseSpec` alone (which the journal records), so that a request resumed after
a restart goes on producing exactly the events it would have produced without one.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import asdict, dataclass, field
from typing import Any

from rtxcore.engine.outputs import RequestOutput, TokenLogprob
from rtxcore.server.http.common import native_logprobs, token_text
from rtxcore.server.http.generation import Choice, Generation
from rtxcore.tokenizer import Tokenizer


@dataclass(slots=True)
class ResponseSpec:
    """What a response looks like beyond the outputs: everything its format needs, as plain JSON values."""

    # "completion", "chat", "native" or "grpc" (a key of FORMATS).
    kind: str
    stream: bool
    # The fields every body and chunk starts with (OpenAI: id, object, created, model; native: id, model).
    header: dict[str, Any] = field(default_factory=dict)
    include_usage: bool = False
    # Whether the request asked for logprobs (and so every chunk carries a logprobs field).
    logprobs: bool = False

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> ResponseSpec:
        return cls(**data)


class ResponseFormat(ABC):
    # Whether a stream ends with ``data: [DONE]`` after its events.
    ends_with_done = True

    def __init__(self, spec: ResponseSpec, tokenizer: Tokenizer | None):
        self.spec = spec
        self.tokenizer = tokenizer

    def opening(self) -> list[dict[str, Any]]:
        """Events sent before any output."""
        return []

    @abstractmethod
    def chunk(self, gen: Generation, choice: Choice, out: RequestOutput) -> dict[str, Any] | None:
        """The event for one output, or None when it carries nothing to send."""

    def closing(self, gen: Generation) -> list[dict[str, Any]]:
        """Events sent after the last output (before ``[DONE]``)."""
        return []

    @abstractmethod
    def body(self, gen: Generation) -> dict[str, Any]:
        """The whole response of a non-streaming request."""


class CompletionFormat(ResponseFormat):
    def chunk(self, gen: Generation, choice: Choice, out: RequestOutput) -> dict[str, Any] | None:
        if not (out.new_text or out.finished or out.logprobs):
            return None
        offset = len(choice.text) - len(out.new_text)
        part = {"index": choice.index, "text": out.new_text, "logprobs": self._logprobs(out.logprobs or [], offset),
                "finish_reason": out.finish_reason}
        return {**self.spec.header, "choices": [part], **self._null_usage()}

    def closing(self, gen: Generation) -> list[dict[str, Any]]:
        return [{**self.spec.header, "choices": [], "usage": gen.usage()}] if self.spec.include_usage else []

    def body(self, gen: Generation) -> dict[str, Any]:
        choices = [{"index": c.index, "text": c.text, "logprobs": self._logprobs(c.logprobs, 0),
                    "finish_reason": c.finish_reason} for c in gen.choices]
        return {**self.spec.header, "choices": choices, "usage": gen.usage()}

    def _null_usage(self) -> dict[str, Any]:
        return {"usage": None} if self.spec.include_usage else {}

    def _logprobs(self, lps: list[TokenLogprob], offset: int) -> dict[str, Any] | None:
        if not self.spec.logprobs:
            return None
        tokens = [token_text(self.tokenizer, lp.token_id) for lp in lps]
        offsets = []
        for token in tokens:
            offsets.append(offset)
            offset += len(token)
        return {"tokens": tokens, "token_logprobs": [lp.logprob for lp in lps],
                "top_logprobs": [{token_text(self.tokenizer, t): p for t, p in lp.top} for lp in lps],
                "text_offset": offsets}


class ChatFormat(CompletionFormat):
    def opening(self) -> list[dict[str, Any]]:
        first = {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
        return [{**self.spec.header, "choices": [first], **self._null_usage()}]

    def chunk(self, gen: Generation, choice: Choice, out: RequestOutput) -> dict[str, Any] | None:
        if not (out.new_text or out.finished or out.logprobs):
            return None
        delta = {"content": out.new_text} if out.new_text else {}
        part = {"index": choice.index, "delta": delta, "logprobs": self._chat_logprobs(out.logprobs or []),
                "finish_reason": out.finish_reason}
        return {**self.spec.header, "choices": [part], **self._null_usage()}

    def body(self, gen: Generation) -> dict[str, Any]:
        choice = gen.choices[0]
        return {**self.spec.header, "choices": [{
            "index": 0, "message": {"role": "assistant", "content": choice.text},
            "logprobs": self._chat_logprobs(choice.logprobs), "finish_reason": choice.finish_reason}],
            "usage": gen.usage()}

    def _chat_logprobs(self, lps: list[TokenLogprob]) -> dict[str, Any] | None:
        if not self.spec.logprobs:
            return None

        def entry(token_id: int, logprob: float) -> dict[str, Any]:
            token = token_text(self.tokenizer, token_id)
            return {"token": token, "logprob": logprob, "bytes": list(token.encode())}

        return {"content": [{**entry(lp.token_id, lp.logprob), "top_logprobs": [entry(t, p) for t, p in lp.top]}
                            for lp in lps]}


class NativeFormat(ResponseFormat):
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


class GrpcFormat(ResponseFormat):
    """gRPC ``Generate`` with a request journal: each event holds one ``GenerateResponse``'s fields (the servicer
    builds the message from it), so a journaled gRPC request is produced, replayed and resumed like an HTTP one.
    Always a stream."""

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


FORMATS: dict[str, type[ResponseFormat]] = {"completion": CompletionFormat, "chat": ChatFormat,
                                            "native": NativeFormat, "grpc": GrpcFormat}


def make_format(spec: ResponseSpec, tokenizer: Tokenizer | None) -> ResponseFormat:
    return FORMATS[spec.kind](spec, tokenizer)
