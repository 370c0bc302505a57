"""vLLM's utility routes: ``/tokenize`` and ``/detokenize`` with the served model's tokenizer, and ``/version``.

``/tokenize`` takes a prompt, or chat messages rendered with the chat template as chat completions render them, so
that its ``count`` is the ``prompt_tokens`` a completion of the same input would use.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from rtxcore import __version__
from rtxcore.engine.input_processor import InputProcessor
from rtxcore.errors import InvalidRequestError
from rtxcore.sampling_params import is_int
from rtxcore.server.http.chat_template_fields import ChatTemplateFields, parse_chat_template_fields
from rtxcore.server.http.common import read_json
from rtxcore.server.http.fields import bool_field, model_field
from rtxcore.server.http.protocol import parse_chat
from rtxcore.server.serving.runtime import ServingRuntime
from rtxcore.tokenizer import Tokenizer

# vLLM's chat fields that change the rendered prompt but this route does not take: refused rather than ignored,
# so a count is never silently wrong.
_UNSUPPORTED_CHAT_FIELDS = ("tools", "mm_processor_kwargs")


@dataclass(slots=True, frozen=True)
class TokenizeRequest:
    """A ``/tokenize`` body: exactly one of ``prompt`` and ``messages``."""

    model: str | None
    # Text encoded as it is; None when messages are given.
    prompt: str | None
    # Chat messages (content flattened to text, as chat completions take them); None when a prompt is given.
    messages: list[dict[str, Any]] | None
    # Messages only: how the template renders them, read as chat completions read it.
    template: ChatTemplateFields
    # BOS/EOS as the tokenizer's flags say; defaults to how completions and chat completions encode.
    add_special_tokens: bool
    # Also answer each token as the vocabulary spells it (``token_strs``).
    return_token_strs: bool


@dataclass(slots=True, frozen=True)
class DetokenizeRequest:
    model: str | None
    token_ids: list[int]


def parse_tokenize(body: dict[str, Any]) -> TokenizeRequest:
    """:raises InvalidRequestError: naming the field at fault."""
    for name in _UNSUPPORTED_CHAT_FIELDS:
        if body.get(name):
            raise InvalidRequestError(f"{name} is not supported", param=name)
    prompt, messages = body.get("prompt"), body.get("messages")
    if prompt is not None and messages is not None:
        raise InvalidRequestError("give either prompt or messages, not both", param="messages")
    if prompt is None and messages is None:
        raise InvalidRequestError("prompt or messages is required", param="prompt")
    if prompt is not None and not isinstance(prompt, str):
        raise InvalidRequestError("prompt must be a string", param="prompt")
    if messages is not None:
        messages = parse_chat({"messages": messages}).messages  # checked and flattened as chat completions do
    return TokenizeRequest(model_field(body), prompt, messages, parse_chat_template_fields(body),
                           _flag(body, "add_special_tokens", True), _flag(body, "return_token_strs", False))


def parse_detokenize(body: dict[str, Any]) -> DetokenizeRequest:
    """:raises InvalidRequestError: naming ``tokens`` when it is not a list of integers (the vocabulary is checked
        against the tokenizer later)."""
    tokens = body.get("tokens")
    if not isinstance(tokens, list) or not all(is_int(t) for t in tokens):
        raise InvalidRequestError("tokens must be a list of token ids", param="tokens")
    return DetokenizeRequest(model_field(body), tokens)


class UtilityRoutes:
    def __init__(self, runtime: ServingRuntime):
        self.runtime = runtime

    def routes(self) -> list[Route]:
        return [
            Route("/tokenize", self.tokenize, methods=["POST"]),
            Route("/detokenize", self.detokenize, methods=["POST"]),
            Route("/version", self.version, methods=["GET"]),
        ]

    async def tokenize(self, request: Request) -> Response:
        """The token ids of a prompt or a chat, their count and the context they must fit in."""
        inputs = self.runtime.engine().inputs
        req = parse_tokenize(await read_json(request))
        self.runtime.check_model(req.model)
        tokenizer = _tokenizer(inputs, "messages" if req.messages is not None else "prompt")
        # Templates and long texts take a while: off the event loop, as the generation routes encode.
        token_ids = await asyncio.to_thread(_encode, inputs, tokenizer, req)
        body: dict[str, Any] = {"count": len(token_ids), "max_model_len": inputs.limits.max_model_len,
                                "tokens": token_ids}
        if req.return_token_strs:
            body["token_strs"] = [tokenizer.id_to_token(t) for t in token_ids]
        return JSONResponse(body)

    async def detokenize(self, request: Request) -> Response:
        """The text of token ids, special tokens included (as vLLM decodes them)."""
        inputs = self.runtime.engine().inputs
        req = parse_detokenize(await read_json(request))
        self.runtime.check_model(req.model)
        tokenizer = _tokenizer(inputs, "tokens")
        vocab_size = tokenizer.vocab_size
        bad = next((t for t in req.token_ids if not 0 <= t < vocab_size), None)
        if bad is not None:
            raise InvalidRequestError(f"tokens must be ids in [0, {vocab_size}); got {bad}", param="tokens")
        text = await asyncio.to_thread(tokenizer.decode, req.token_ids, skip_special_tokens=False)
        return JSONResponse({"prompt": text})

    async def version(self, request: Request) -> Response:
        return JSONResponse({"version": __version__})


def _encode(inputs: InputProcessor, tokenizer: Tokenizer, req: TokenizeRequest) -> list[int]:
    if req.messages is None:
        assert req.prompt is not None  # parse_tokenize gives one or the other
        text = req.prompt
    else:  # chat completions' own rendering
        rendering = req.template
        text = inputs.apply_chat_template(req.messages, rendering.add_generation_prompt,
                                          rendering.continue_final_message, rendering.template_vars)
    return tokenizer.encode(text, add_special_tokens=req.add_special_tokens)


def _tokenizer(inputs: InputProcessor, param: str) -> Tokenizer:
    if inputs.tokenizer is None:
        raise InvalidRequestError(f"model {inputs.model_name} has no tokenizer", param=param)
    return inputs.tokenizer


def _flag(body: dict[str, Any], name: str, default: bool) -> bool:
    value = body.get(name)
    return default if value is None else bool_field(value, name)
