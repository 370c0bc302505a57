"""OpenAI-compatible routes: ``/v1/completions``, ``/v1/chat/completions``, ``/v1/embeddings``, ``/v1/models``."""

from __future__ import annotations

import asyncio
import base64
import time
from typing import Any, AsyncIterator, Callable

import numpy as np
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from rtxcore.engine.llm_engine import LLMEngine
from rtxcore.engine.outputs import RequestOutput, TokenLogprob
from rtxcore.errors import RtxError
from rtxcore.server.http.common import check_model, read_json, request_id, route, token_text, traceparent
from rtxcore.server.http.errors import APIError
from rtxcore.server.http.generation import Choice, Generation, embed, ensure_engine, tokenize
from rtxcore.server.http.protocol import DEFAULT_CHAT_MAX_TOKENS, make_sampling_params, parse_chat, \
    parse_completion, parse_embedding
from rtxcore.server.http.sse import DONE, EventStreamResponse, sse_data
from rtxcore.server.runtime import ServingRuntime

# Builds one choice's part of a chunk from the output just produced.
ChunkChoice = Callable[[Choice, RequestOutput], dict[str, Any] | None]


class OpenAIRoutes:
    def __init__(self, runtime: ServingRuntime):
        self.runtime = runtime

    def routes(self) -> list[Route]:
        return [
            Route("/v1/completions", self.completions, methods=["POST"]),
            Route("/v1/chat/completions", self.chat_completions, methods=["POST"]),
            Route("/v1/embeddings", self.embeddings, methods=["POST"]),
            Route("/v1/models", self.list_models, methods=["GET"]),
            Route("/v1/models/{model:path}", self.get_model, methods=["GET"]),
        ]

    # -- completions ----------------------------------------------------------------------------------------------

    async def completions(self, request: Request) -> Response:
        async_engine = ensure_engine(self.runtime)
        engine = async_engine.engine
        req = parse_completion(await read_json(request))
        check_model(self.runtime, req.model)
        where = route(self.runtime, request, req.routing)
        prompts = await tokenize(engine, req.prompts)
        params = make_sampling_params(req.params)
        gen = await Generation.start(self.runtime, request_id(request), prompts, params, traceparent(request), where)
        header = {"id": f"cmpl-{gen.req_id}", "object": "text_completion", "created": int(time.time()),
                  "model": self.runtime.model_name}

        def logprobs(lps: list[TokenLogprob], offset: int) -> dict[str, Any] | None:
            return _completion_logprobs(engine, lps, offset) if params.logprobs is not None else None

        if req.stream:
            def chunk_choice(choice: Choice, out: RequestOutput) -> dict[str, Any] | None:
                if not (out.new_text or out.finished or out.logprobs):
                    return None
                offset = len(choice.text) - len(out.new_text)
                return {"index": choice.index, "text": out.new_text, "logprobs": logprobs(out.logprobs or [], offset),
                        "finish_reason": out.finish_reason}

            events = _openai_events(gen, header, chunk_choice, [], req.include_usage)
            return EventStreamResponse(events, on_close=gen.close)
        await gen.collect(request)
        choices = [{"index": c.index, "text": c.text, "logprobs": logprobs(c.logprobs, 0),
                    "finish_reason": c.finish_reason} for c in gen.choices]
        return JSONResponse({**header, "choices": choices, "usage": gen.usage()})

    # -- chat -----------------------------------------------------------------------------------------------------

    async def chat_completions(self, request: Request) -> Response:
        async_engine = ensure_engine(self.runtime)
        engine = async_engine.engine
        req = parse_chat(await read_json(request))
        check_model(self.runtime, req.model)
        where = route(self.runtime, request, req.routing)
        # Reading the tokenizer is thread-safe; the template can be slow, so it runs off the event loop.
        text = await asyncio.to_thread(engine.apply_chat_template, req.messages)
        prompts = await tokenize(engine, [text], "messages")
        params = dict(req.params)
        params["max_tokens"] = req.max_tokens if req.max_tokens is not None else _room_left(engine, len(prompts[0]))
        sampling = make_sampling_params(params)
        gen = await Generation.start(self.runtime, request_id(request), prompts, sampling, traceparent(request),
                                     where)
        header = {"id": f"chatcmpl-{gen.req_id}", "object": "chat.completion", "created": int(time.time()),
                  "model": self.runtime.model_name}

        def logprobs(lps: list[TokenLogprob]) -> dict[str, Any] | None:
            return _chat_logprobs(engine, lps) if sampling.logprobs is not None else None

        if req.stream:
            header["object"] = "chat.completion.chunk"
            first = [{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                      "finish_reason": None}]

            def chunk_choice(choice: Choice, out: RequestOutput) -> dict[str, Any] | None:
                if not (out.new_text or out.finished or out.logprobs):
                    return None
                delta = {"content": out.new_text} if out.new_text else {}
                return {"index": choice.index, "delta": delta, "logprobs": logprobs(out.logprobs or []),
                        "finish_reason": out.finish_reason}

            events = _openai_events(gen, header, chunk_choice, first, req.include_usage)
            return EventStreamResponse(events, on_close=gen.close)
        await gen.collect(request)
        choice = gen.choices[0]
        return JSONResponse({**header, "choices": [{
            "index": 0, "message": {"role": "assistant", "content": choice.text},
            "logprobs": logprobs(choice.logprobs), "finish_reason": choice.finish_reason}], "usage": gen.usage()})

    # -- embeddings -----------------------------------------------------------------------------------------------

    async def embeddings(self, request: Request) -> Response:
        async_engine = ensure_engine(self.runtime)
        req = parse_embedding(await read_json(request))
        check_model(self.runtime, req.model)
        token_lists = await tokenize(async_engine.engine, req.inputs, "input")
        vectors = await embed(self.runtime, request, token_lists)
        data = [{"object": "embedding", "index": i, "embedding": _encode_vector(v, req.encoding_format)}
                for i, v in enumerate(vectors)]
        num_tokens = sum(len(t) for t in token_lists)
        return JSONResponse({"object": "list", "data": data, "model": self.runtime.model_name,
                             "usage": {"prompt_tokens": num_tokens, "total_tokens": num_tokens}})

    # -- models ---------------------------------------------------------------------------------------------------

    async def list_models(self, request: Request) -> Response:
        ensure_engine(self.runtime)
        return JSONResponse({"object": "list", "data": [self._model_card()]})

    async def get_model(self, request: Request) -> Response:
        ensure_engine(self.runtime)
        check_model(self.runtime, request.path_params["model"])
        return JSONResponse(self._model_card())

    def _model_card(self) -> dict[str, Any]:
        engine = self.runtime.async_engine.engine
        return {"id": self.runtime.model_name, "object": "model", "created": self.runtime.started_at,
                "owned_by": "rtx-serve", "root": engine.source.name, "max_model_len": engine.max_model_len}


async def _openai_events(gen: Generation, header: dict[str, Any], chunk_choice: ChunkChoice,
                         first: list[dict[str, Any]], include_usage: bool) -> AsyncIterator[bytes]:
    usage: dict[str, Any] = {"usage": None} if include_usage else {}
    try:
        if first:
            yield sse_data({**header, "choices": first, **usage})
        async for choice, out in gen.outputs():
            part = chunk_choice(choice, out)
            if part is not None:
                yield sse_data({**header, "choices": [part], **usage})
        if include_usage:
            yield sse_data({**header, "choices": [], "usage": gen.usage()})
    except TimeoutError:
        yield sse_data(gen.timeout_error().body())
    except RtxError as exc:
        yield sse_data(APIError(500, str(exc)).body())
    finally:
        gen.close()
    yield DONE


def _room_left(engine: LLMEngine, num_prompt_tokens: int) -> int:
    """Chat's default max_tokens: what the context and the KV cache leave after the prompt, capped."""
    cache_tokens = engine.kv_cache.num_usable_blocks * engine.config.block_size
    room = min(engine.max_model_len, cache_tokens) - num_prompt_tokens
    return max(1, min(room, DEFAULT_CHAT_MAX_TOKENS))  # a prompt with no room left is refused by the engine


def _completion_logprobs(engine: LLMEngine, lps: list[TokenLogprob], offset: int) -> dict[str, Any]:
    tokens = [token_text(engine, lp.token_id) for lp in lps]
    offsets = []
    for token in tokens:
        offsets.append(offset)
        offset += len(token)
    return {"tokens": tokens, "token_logprobs": [lp.logprob for lp in lps],
            "top_logprobs": [{token_text(engine, t): p for t, p in lp.top} for lp in lps], "text_offset": offsets}


def _chat_logprobs(engine: LLMEngine, lps: list[TokenLogprob]) -> dict[str, Any]:
    def entry(token_id: int, logprob: float) -> dict[str, Any]:
        token = token_text(engine, token_id)
        return {"token": token, "logprob": logprob, "bytes": list(token.encode())}

    return {"content": [{**entry(lp.token_id, lp.logprob), "top_logprobs": [entry(t, p) for t, p in lp.top]}
                        for lp in lps]}


def _encode_vector(vector: list[float], encoding_format: str) -> list[float] | str:
    if encoding_format == "base64":
        return base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode()
    return vector
