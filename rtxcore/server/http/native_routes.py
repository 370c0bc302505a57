"""Native routes: ``/generate`` and ``/embed``, plus the probes ``/health``, ``/ready`` and ``/metrics``."""

from __future__ import annotations

from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from rtxcore.errors import RequestError
from rtxcore.server.http.common import (
    read_json,
    received_at,
    request_id,
    request_route,
    tenant_of,
    trace_headers,
    until_disconnected,
)
from rtxcore.server.http.errors import headers_of, status_of
from rtxcore.server.http.protocol import make_sampling_params, parse_embed, parse_generate
from rtxcore.server.http.responses import serve_generation
from rtxcore.server.http.sse import EventStreamResponse
from rtxcore.server.serving.embedding import embed
from rtxcore.server.serving.formats import ResponseSpec, openai_error_body
from rtxcore.server.serving.generation import Generation, Speculation, tokenize
from rtxcore.server.serving.lifecycle import Started
from rtxcore.server.serving.runtime import ServingRuntime


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

    async def generate(self, request: Request) -> Response | EventStreamResponse:
        """Stream (by default) or return one completion; the body holds the prompt and :class:`SamplingParams`
        fields."""
        return await serve_generation(self.runtime, request, self._start_generate)

    async def _start_generate(self, request: Request, body: dict[str, Any]) -> Started:
        req = parse_generate(body)
        where = request_route(self.runtime, request, req.routing)
        prompts = await tokenize(self.runtime.engine().inputs, [req.prompt])
        params = make_sampling_params(req.params)
        speculation = Speculation(req.speculation.draft_token_ids, req.speculation.speculative)
        gen = await Generation.start(self.runtime, request_id(request), prompts, params, trace_headers(request), where,
                                     speculation=speculation, received_at=received_at(request))
        spec = ResponseSpec("native", req.stream, {"id": gen.req_id, "model": self.runtime.model_name},
                            logprobs=params.logprobs is not None)
        return Started(gen, spec, prompts, params)

    async def embed(self, request: Request) -> Response:
        engine = self.runtime.engine()
        token_lists = await tokenize(engine.inputs, parse_embed(await read_json(request)), "inputs")
        vectors = await until_disconnected(request, embed(self.runtime, tenant_of(request), token_lists,
                                                          "inputs"))
        return JSONResponse({"model": self.runtime.model_name, "embeddings": vectors,
                             "num_tokens": [len(t) for t in token_lists]})

    async def lanes(self, request: Request) -> Response:
        """The SLA lanes and their targets, and the scheduler's live state of them (queues, brownout)."""
        engine = self.runtime.engine()
        status = await engine.run_on_engine(lambda core: core.scheduler.status())
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
        """The process is alive and answering (liveness); says what it is doing. 503 once the engine loop has
        failed: nothing in this process will serve again, so a liveness probe should restart it."""
        state = self.runtime.state
        if state == "failed":
            error = self.runtime.load_error or (self.runtime.async_engine and self.runtime.async_engine.error)
            return JSONResponse({"status": "failed", "state": state, "error": repr(error)}, status_code=503)
        return JSONResponse({"status": "ok", "state": state})

    async def ready(self, request: Request) -> Response:
        """200 once the model is loaded, the engine thread is stepping and the journal (if any) takes writes; 503
        (with the reason) otherwise."""
        try:
            self.runtime.check_ready()
        except RequestError as exc:
            body = {**openai_error_body(exc), "status": "unavailable", "state": self.runtime.state}
            return JSONResponse(body, status_code=status_of(exc), headers=headers_of(exc))
        return JSONResponse({"status": "ready", "model": self.runtime.model_name,
                             "backend": self.runtime.backend_name})

    async def metrics(self, request: Request) -> Response:
        body, content_type = self.runtime.metrics.render()
        return Response(body, media_type=content_type)
