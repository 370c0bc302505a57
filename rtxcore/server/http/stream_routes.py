"""``GET /v1/streams/{request_id}``: the rest of a request's response, for a client whose connection broke.

A stream resumes after the event named by the ``Last-Event-ID`` header (or ``?last_event_id=``): events already
sent are replayed from the journal's copy, then live ones follow, then ``[DONE]``; without one, from the start. A
non-streaming request answers with its full body once it has finished. Only the tenant that made a request may
resume it: for any other, the request does not exist (404), whether or not it does.
"""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from rtxcore.server.http.common import tenant_name
from rtxcore.server.http.errors import APIError
from rtxcore.server.http.responses import answer, last_event_id
from rtxcore.server.http.sse import EventStreamResponse
from rtxcore.server.serving.lifecycle import find
from rtxcore.server.serving.runtime import ServingRuntime


class StreamRoutes:
    def __init__(self, runtime: ServingRuntime):
        self.runtime = runtime

    def routes(self) -> list[Route]:
        return [Route("/v1/streams/{request_id}", self.resume, methods=["GET"])]

    async def resume(self, request: Request) -> Response | EventStreamResponse:
        runtime = self.runtime
        runtime.engine()
        req_id = request.path_params["request_id"]
        if runtime.durable is None:  # no such stream here: a URL of this server that names nothing
            raise APIError(404, "resumable streams need a server started with --state-dir", param="request_id")
        entry = find(runtime, req_id, tenant_name(request))
        if entry.kind == "grpc":
            raise APIError(400, f"request {req_id!r} was made over gRPC: resume it with the Resume call",
                           param="request_id", code="invalid_value")
        after = last_event_id(request, entry)
        runtime.durable.stats.num_stream_resumes += 1
        return await answer(request, entry, after, detached=True)
