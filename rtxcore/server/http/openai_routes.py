"""OpenAI-compatible routes: ``/v1/completions``, ``/v1/chat/completions``, ``/v1/responses``, ``/v1/embeddings``,
``/v1/models`` and ``/v1/models/{id}``."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import time
from collections.abc import Iterator, Sequence
from dataclasses import replace
from typing import Any

import numpy as np
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from rtxcore.engine.input_processor import InputProcessor, Prompt
from rtxcore.errors import InvalidRequestError
from rtxcore.server.http.common import (
    read_json,
    received_at,
    request_id,
    request_route,
    tenant_of,
    trace_headers,
    until_disconnected,
)
from rtxcore.server.http.protocol import (
    DEFAULT_CHAT_MAX_TOKENS,
    ChatRequest,
    SpeculationFields,
    make_sampling_params,
    parse_chat,
    parse_completion,
    parse_embedding,
    truncate_prompts,
)
from rtxcore.server.http.responses import serve_generation
from rtxcore.server.http.responses_request import parse_responses
from rtxcore.server.http.sse import EventStreamResponse
from rtxcore.server.http.structured_fields import structured_output_field
from rtxcore.server.serving.embedding import embed
from rtxcore.server.serving.formats import ResponseSpec
from rtxcore.server.serving.generation import Generation, Speculation, encode_prediction, tokenize
from rtxcore.server.serving.lifecycle import Started
from rtxcore.server.serving.runtime import ServingRuntime
from rtxcore.server.serving.tool_calls import ToolRequest, required_grammar, tool_messages
from rtxcore.server.serving.tool_formats import ToolCallFormat, format_for


class OpenAIRoutes:
    def __init__(self, runtime: ServingRuntime):
        self.runtime = runtime

    def routes(self) -> list[Route]:
        return [
            Route("/v1/completions", self.completions, methods=["POST"]),
            Route("/v1/chat/completions", self.chat_completions, methods=["POST"]),
            Route("/v1/responses", self.responses, methods=["POST"]),
            Route("/v1/embeddings", self.embeddings, methods=["POST"]),
            Route("/v1/models", self.list_models, methods=["GET"]),
            Route("/v1/models/{model:path}", self.get_model, methods=["GET"]),
        ]

    # -- completions ----------------------------------------------------------------------------------------------

    async def completions(self, request: Request) -> Response | EventStreamResponse:
        return await serve_generation(self.runtime, request, self._start_completion)

    async def _start_completion(self, request: Request, body: dict[str, Any]) -> Started:
        inputs = self.runtime.engine().inputs
        req = parse_completion(body)
        self.runtime.check_model(req.model)
        where = request_route(self.runtime, request, req.routing)
        prompts = truncate_prompts(await tokenize(inputs, req.prompts), req.truncation, inputs.limits.max_model_len)
        logprobs = req.params.get("logprobs") is not None
        # best_of ranks choices by their log-probability: the engine reports it even when the body did not ask.
        params = make_sampling_params(req.params if logprobs or req.best_of == req.n else {**req.params, "logprobs": 0})
        speculation = await _speculation(inputs, req.speculation)
        with _named_as_sent(body):
            gen = await Generation.start(self.runtime, request_id(request), prompts, params, trace_headers(request),
                                         where, speculation=speculation, n=req.best_of,
                                         received_at=received_at(request))
        try:
            # A truncated prompt echoes what the model saw.
            sent = req.prompts if req.truncation is None else prompts
            # Scoring a long prompt takes passes of its own: a client gone meanwhile stops the ones not yet run.
            echo = (await until_disconnected(request, self._echo(sent, prompts, params.logprobs if logprobs else None))
                    if req.echo else None)
        except BaseException:
            gen.close()
            raise
        header = {"id": f"cmpl-{gen.req_id}", "object": "text_completion", "created": int(time.time()),
                  "model": self.runtime.model_name}
        spec = ResponseSpec("completion", req.stream, header, req.include_usage, logprobs, n=req.n,
                            best_of=req.best_of, echo=echo, param_names=_names_as_sent(body))
        return Started(gen, spec, prompts, params, n=req.best_of)

    async def _echo(self, sent: Sequence[Prompt], prompts: list[list[int]],
                    num_top: int | None) -> list[dict[str, Any]]:
        """What echo puts before each prompt's choices: the prompt as sent (token ids decoded), and with logprobs,
        each prompt token's log-probability from one scoring pass (rtxcore.engine.prompt_scoring)."""
        engine = self.runtime.engine()
        tokenizer = engine.inputs.tokenizer  # token-id prompts of a model without one echo no text (their logprobs
        texts = [p if isinstance(p, str) else tokenizer.decode(p, skip_special_tokens=False) if tokenizer else ""
                 for p in sent]  # name each token as token_id:N)
        if num_top is None:
            return [{"text": text, "logprobs": None} for text in texts]
        scored = await engine.prompt_logprobs(prompts, num_top)
        return [{"text": text, "logprobs": [[ids[0], None, None], *[
                    [lp.token_id, lp.logprob, [[t, p] for t, p in lp.top]] for lp in lps[1:] if lp is not None]]}
                for text, ids, lps in zip(texts, prompts, scored)]

    # -- chat -----------------------------------------------------------------------------------------------------

    async def chat_completions(self, request: Request) -> Response | EventStreamResponse:
        return await serve_generation(self.runtime, request, self._start_chat)

    async def _start_chat(self, request: Request, body: dict[str, Any]) -> Started:
        return await self._start_conversation(request, body, parse_chat(body), None)

    # -- responses ------------------------------------------------------------------------------------------------

    async def responses(self, request: Request) -> Response | EventStreamResponse:
        return await serve_generation(self.runtime, request, self._start_responses)

    async def _start_responses(self, request: Request, body: dict[str, Any]) -> Started:
        """A Responses request runs as the chat request it translates to; only its response differs."""
        translated = parse_responses(body)
        with _responses_names():
            return await self._start_conversation(request, translated.chat_body, parse_chat(translated.chat_body),
                                                  translated.echo)

    async def _start_conversation(self, request: Request, body: dict[str, Any], req: ChatRequest,
                                  responses_echo: dict[str, Any] | None) -> Started:
        """Chat, or with ``responses_echo`` (what the response repeats of its request) the Responses API."""
        inputs = self.runtime.engine().inputs
        self.runtime.check_model(req.model)
        where = request_route(self.runtime, request, req.routing)
        messages, template_vars = req.messages, dict[str, Any]()
        params = dict(req.params)
        tools = req.tools if req.tools is not None and req.tools.tools else None
        call_format = None
        if tools is not None:
            template = inputs.tokenizer.chat_template if inputs.tokenizer is not None else None
            fmt = format_for(template)
            # With tool_choice "none" too, as OpenAI and vLLM do: the model still sees the tools (and the calls of
            # earlier turns) but is told not to call one, and its answer is not parsed for calls.
            messages, template_vars = tool_messages(req.messages, tools, template, fmt)
            if tools.active:
                call_format = fmt
                await self._hold_to_calls(inputs, tools, fmt, params)
        # Reading the tokenizer is thread-safe; the template can be slow, so it runs off the event loop.
        rendering = req.template
        text = await asyncio.to_thread(inputs.apply_chat_template, messages, rendering.add_generation_prompt,
                                       rendering.continue_final_message, {**rendering.template_vars, **template_vars})
        prompts = truncate_prompts(await tokenize(inputs, [text], "messages"), req.truncation,
                                   inputs.limits.max_model_len)
        params["max_tokens"] = req.max_tokens if req.max_tokens is not None else _room_left(inputs, len(prompts[0]))
        sampling = make_sampling_params(params)
        speculation = await _speculation(inputs, req.speculation)
        with _named_as_sent(body):
            gen = await Generation.start(self.runtime, request_id(request), prompts, sampling,
                                         trace_headers(request), where, speculation=speculation, n=req.n,
                                         received_at=received_at(request))
        tool_format = call_format.name if call_format is not None else None
        names = _names_as_sent(body)
        if responses_echo is not None:
            header = {"id": f"resp_{gen.req_id}", "created_at": int(time.time()), "model": self.runtime.model_name}
            spec = ResponseSpec("responses", req.stream, header, logprobs=sampling.logprobs is not None,
                                tools=tool_format, request=responses_echo,
                                param_names={k: _RESPONSES_NAMES.get(v, v) for k, v in names.items()})
            return Started(gen, spec, prompts, sampling)
        header = {"id": f"chatcmpl-{gen.req_id}", "object": "chat.completion.chunk" if req.stream else
                  "chat.completion", "created": int(time.time()), "model": self.runtime.model_name}
        spec = ResponseSpec("chat", req.stream, header, req.include_usage, sampling.logprobs is not None,
                            tools=tool_format, n=req.n, param_names=names)
        return Started(gen, spec, prompts, sampling, n=req.n)

    @staticmethod
    async def _hold_to_calls(inputs: InputProcessor, tools: ToolRequest, fmt: ToolCallFormat,
                             params: dict[str, Any]) -> None:
        """Set what the calls of ``fmt`` need of sampling: a grammar where a call is required."""
        grammar = required_grammar(tools, fmt)
        if grammar is not None:  # a call is required: the grammar makes it one that parses
            params["structured_output"] = {"grammar": grammar}
        else:
            # "auto": the parameter schemas are compiled as a required call's grammar would be (and kept for one),
            # so a bad schema is refused whatever tool_choice says, as OpenAI does.
            required = required_grammar(replace(tools, choice="required"), fmt)
            await asyncio.to_thread(inputs.logits.check, "structured_output", {"grammar": required}, "tools")
        if fmt.keeps_special_tokens:  # its tags are special tokens: skipped, the calls would vanish
            params["skip_special_tokens"] = False

    # -- embeddings -----------------------------------------------------------------------------------------------

    async def embeddings(self, request: Request) -> Response:
        engine = self.runtime.engine()
        req = parse_embedding(await read_json(request))
        self.runtime.check_model(req.model)
        token_lists = truncate_prompts(await tokenize(engine.inputs, req.inputs, "input"), req.truncation,
                                       engine.inputs.limits.max_model_len)
        vectors = await until_disconnected(request, embed(self.runtime, tenant_of(request), token_lists))
        data = [{"object": "embedding", "index": i, "embedding": _encode_vector(v, req.encoding_format)}
                for i, v in enumerate(vectors)]
        num_tokens = sum(len(t) for t in token_lists)
        return JSONResponse({"object": "list", "data": data, "model": self.runtime.model_name,
                             "usage": {"prompt_tokens": num_tokens, "total_tokens": num_tokens}})

    # -- models ---------------------------------------------------------------------------------------------------

    async def list_models(self, request: Request) -> Response:
        self.runtime.engine()
        return JSONResponse({"object": "list", "data": [self._model_card(self.runtime.model_name)]})

    async def get_model(self, request: Request) -> Response:
        """The model under one of its served names (``--served-model-name a b``: ``a`` and ``b`` are model ids); a
        further name a request may give (the source's own name, ``default``) answers with the first served name.

        :raises RequestError: NOT_FOUND for a name this server does not serve.
        """
        self.runtime.engine()
        model_id = request.path_params["model"]
        self.runtime.check_model(model_id)
        served = (self.runtime.model_name, *self.runtime.settings.served_model_aliases)
        return JSONResponse(self._model_card(model_id if model_id in served else self.runtime.model_name))

    def _model_card(self, model_id: str) -> dict[str, Any]:
        core = self.runtime.engine().core
        return {"id": model_id, "object": "model", "created": self.runtime.started_at,
                "owned_by": "rtx-serve", "root": core.source.name, "max_model_len": core.max_model_len}


async def _speculation(inputs: InputProcessor, fields: SpeculationFields) -> Speculation:
    """The request's ``prediction`` as draft token ids (encoded even when ``speculative`` is false, so a bad one is
    refused whatever the flag)."""
    return Speculation(await encode_prediction(inputs, fields.prediction), fields.speculative)


def _room_left(inputs: InputProcessor, num_prompt_tokens: int) -> int:
    """Chat's default max_tokens: what the context and the KV cache leave after the prompt, capped."""
    room = inputs.room_left(num_prompt_tokens)
    return max(1, min(room, DEFAULT_CHAT_MAX_TOKENS))  # a prompt with no room left is refused by the engine


def _encode_vector(vector: list[float], encoding_format: str) -> list[float] | str:
    if encoding_format == "base64":
        return base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode()
    return vector


@contextlib.contextmanager
def _responses_names() -> Iterator[None]:
    """Errors of a Responses request name its own fields, not the chat fields it was translated to."""
    try:
        yield
    except InvalidRequestError as exc:
        exc.rename_param(_RESPONSES_NAMES)
        raise


_RESPONSES_NAMES = {"response_format": "text.format", "max_completion_tokens": "max_output_tokens",
                    "messages": "input", "logprobs": "include"}


def _names_as_sent(body: dict[str, Any]) -> dict[str, str]:
    """The body's names of engine parameters: a grammar the engine refuses is named by the field the body gave it in
    (``response_format``, a ``guided_*`` field, ``tools``...), not by the engine's own name for it; an output budget
    by ``max_completion_tokens`` where the body used it."""
    # A required tool call's grammar is built from the tools' parameter schemas.
    field = structured_output_field(body) or ("tools" if body.get("tools") else None)
    names = {"structured_output": field} if field is not None else {}
    if body.get("max_completion_tokens") is not None:  # the newer name wins, as in parse_chat
        names["max_tokens"] = "max_completion_tokens"
    return names


@contextlib.contextmanager
def _named_as_sent(body: dict[str, Any]) -> Iterator[None]:
    try:
        yield
    except InvalidRequestError as exc:
        exc.rename_param(_names_as_sent(body))
        raise
