"""``GET /v1/streams/{request_id}``: the rest of a request's response, for a client whose connection broke;
``DELETE /v1/streams/{request_id}``: stop it.

A stream resumes after the event named by the ``Last-Event-ID`` header (or ``?last_event_id=``): events already
sent are replayed from the journal's copy, then live ones follow, then ``[DONE]``; without one, from the start. A
non-streaming request answers with its full body once it has finished. Only the tenant that made a request may
resume or cancel it: for any other, the request does not exist (404), whether or not it does.

With a journal a request outlives its client, so leaving is no way to stop one (a chat's "stop" button): DELETE
ends it, each choice finishing with finish_reason "abort", its streams closing with that last event.
"""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from rtxcore.server.http.common import tenant_name
from rtxcore.server.http.errors import APIError
from rtxcore.server.http.responses import answer, last_event_id
from rtxcore.server.http.sse import EventStreamResponse
from rtxcore.server.serving.lifecycle import cancel, find
from rtxcore.server.serving.runtime import ServingRuntime
from rtxcore.server.serving.served_request import ServedRequest


class StreamRoutes:
    def __init__(self, runtime: ServingRuntime):
        self.runtime = runtime

    def routes(self) -> list[Route]:
        return [Route("/v1/streams/{request_id}", self.resume, methods=["GET"]),
                Route("/v1/streams/{request_id}", self.cancel, methods=["DELETE"])]

    async def resume(self, request: Request) -> Response | EventStreamResponse:
        runtime = self.runtime
        entry = self._find(request)
        after = last_event_id(request, entry)
        assert runtime.durable is not None  # _find answered 404 otherwise
        runtime.durable.stats.num_stream_resumes += 1
        return await answer(request, entry, after, detached=True)

    async def cancel(self, request: Request) -> Response:
        entry = self._find(request)
        cancelled = await cancel(self.runtime, entry)
        return JSONResponse({"id": entry.req_id, "object": "stream.cancellation", "cancelled": cancelled})

    def _find(self, request: Request) -> ServedRequest:
        runtime = self.runtime
        runtime.engine()
        req_id = request.path_params["request_id"]
        if runtime.durable is None:  # no such stream here: a URL of this server that names nothing
            raise APIError(404, "resumable streams need a server started with --state-dir", param="request_id")
        entry = find(runtime, req_id, tenant_name(request))
        if entry.kind == "grpc":
            verb = "resume it with the Resume call" if request.method == "GET" else "cancel it with the Cancel call"
            raise APIError(400, f"request {req_id!r} was made over gRPC: {verb}", param="request_id",
                           code="invalid_value")
        return entry
