"""Native routes: ``/generate`` and ``/embed``, plus the probes ``/health``, ``/ready`` and ``/metrics``."""

from __future__ import annotations

from typing import Any, AsyncIterator

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from rtxcore.errors import RtxError
from rtxcore.server.http.common import native_logprobs, read_json, request_id, route, traceparent
from rtxcore.server.http.errors import APIError
from rtxcore.server.http.generation import Generation, embed, ensure_engine, tokenize
from rtxcore.server.http.protocol import make_sampling_params, parse_embed, parse_generate
from rtxcore.server.http.sse import EventStreamResponse, sse_data
from rtxcore.server.runtime import ServingRuntime


class NativeRoutes:
    def __init__(self, runtime: ServingRuntime):
        self.runtime = runtime

    def routes(self) -> list[Route]:
        return [
            Route("/generate", self.generate, methods=["POST"]),
            Route("/embed", self.embed, methods=["POST"]),
            Route("/v1/lanes", self.lanes, methods=["GET"]),
            Route("/health", self.health, methods=["GET"]),
            Route("/ready", self.ready, methods=["GET"]),
            Route("/metrics", self.metrics, methods=["GET"]),
        ]

    async def generate(self, request: Request) -> Response:
        """Stream (by default) or return one completion; the body holds the prompt and :class:`SamplingParams`
        fields."""
        async_engine = ensure_engine(self.runtime)
        req = parse_generate(await read_json(request))
        where = route(self.runtime, request, req.routing)
        prompts = await tokenize(async_engine.engine, [req.prompt])
        params = make_sampling_params(req.params)
        gen = await Generation.start(self.runtime, request_id(request), prompts, params, traceparent(request), where)
        if req.stream:
            return EventStreamResponse(_native_events(gen), on_close=gen.close)
        await gen.collect(request)
        choice = gen.choices[0]
        return JSONResponse({"id": gen.req_id, "model": self.runtime.model_name, "text": choice.text,
                             "num_tokens": choice.num_tokens, "finish_reason": choice.finish_reason,
                             "logprobs": native_logprobs(choice.logprobs) if params.logprobs is not None else None,
                             "usage": gen.usage()})

    async def embed(self, request: Request) -> Response:
        async_engine = ensure_engine(self.runtime)
        token_lists = await tokenize(async_engine.engine, parse_embed(await read_json(request)), "inputs")
        vectors = await embed(self.runtime, request, token_lists)
        return JSONResponse({"model": self.runtime.model_name, "embeddings": vectors,
                             "num_tokens": [len(t) for t in token_lists]})

    async def lanes(self, request: Request) -> Response:
        """The SLA lanes and their targets, and the scheduler's live state of them (queues, brownout)."""
        async_engine = ensure_engine(self.runtime)
        status = await async_engine.run_on_engine(lambda engine: engine.scheduler.status())
        config = self.runtime.engine_config.scheduling
        lanes = [{**spec.to_json(), **({"queued": status.queued.get(name, 0), "running": status.running.get(name, 0)}
                                       if status is not None else {})}
                 for name, spec in config.lanes.items()]
        body = {"scheduler": self.runtime.engine_config.scheduler, "lane_aware": status is not None, "lanes": lanes,
                "brownout_level": status.brownout_level if status is not None else None,
                "brownout_steps": list(status.brownout_steps) if status is not None else [],
                "pressure": status.pressure if status is not None else None}
        return JSONResponse(body)

    async def health(self, request: Request) -> Response:
        """The process is alive and answering (liveness); says what it is doing."""
        return JSONResponse({"status": "ok", "state": self._state()})

    async def ready(self, request: Request) -> Response:
        """200 once the model is loaded and the engine thread is stepping; 503 (with the reason) otherwise."""
        try:
            ensure_engine(self.runtime)
        except APIError as exc:
            body = {**exc.body(), "status": "unavailable", "state": self._state()}
            return JSONResponse(body, status_code=503, headers=exc.headers)
        return JSONResponse({"status": "ready", "model": self.runtime.model_name,
                             "backend": self.runtime.backend_name})

    async def metrics(self, request: Request) -> Response:
        body, content_type = self.runtime.metrics.render()
        return Response(body, media_type=content_type)

    def _state(self) -> str:
        runtime = self.runtime
        if runtime.draining:
            return "draining"
        if runtime.load_error is not None:
            return "failed"
        if runtime.async_engine is None:
            return "loading"
        return "serving" if runtime.async_engine.is_running else "failed"


async def _native_events(gen: Generation) -> AsyncIterator[bytes]:
    """One event per engine output: ``{"text", "token_ids", "finished", ...}``; the last one has the usage."""
    try:
        async for _, out in gen.outputs():
            event: dict[str, Any] = {"text": out.new_text, "token_ids": out.new_token_ids, "finished": out.finished}
            if out.logprobs is not None:
                event["logprobs"] = native_logprobs(out.logprobs)
            if out.finished:
                event.update(finish_reason=out.finish_reason, usage=gen.usage())
            yield sse_data(event)
    except TimeoutError:
        yield sse_data(gen.timeout_error().body())
    except RtxError as exc:
        yield sse_data(APIError(500, str(exc)).body())
    finally:
        gen.close()
