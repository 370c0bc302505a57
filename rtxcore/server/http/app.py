"""The HTTP application: OpenAI-compatible and native routes over one :class:`ServingRuntime`."""

from __future__ import annotations

import logging

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response

from rtxcore.errors import RequestError, RtxError
from rtxcore.server.fleet import FleetWatcher
from rtxcore.server.http.auth import AuthMiddleware
from rtxcore.server.http.common import ClientGone
from rtxcore.server.http.dashboard_routes import DashboardRoutes
from rtxcore.server.http.docs_routes import DocsRoutes
from rtxcore.server.http.errors import APIError, api_error_handler, http_exception_handler, request_error_handler
from rtxcore.server.http.middleware import RequestContextMiddleware, loggable
from rtxcore.server.http.native_routes import NativeRoutes
from rtxcore.server.http.openai_routes import OpenAIRoutes
from rtxcore.server.http.stream_routes import StreamRoutes
from rtxcore.server.http.utility_routes import UtilityRoutes
from rtxcore.server.serving.runtime import ServingRuntime

log = logging.getLogger("rtx.http")

# Response headers a browser page may read: the request id (to resume a stream) and when to retry.
EXPOSED_HEADERS = ["x-rtx-request-id", "retry-after", "x-request-id"]
# Logged for a client that left before its answer was ready (nginx's convention); the client never sees it.
CLIENT_CLOSED_REQUEST = 499


def build_app(runtime: ServingRuntime, fleet: FleetWatcher | None = None) -> Starlette:
    """``fleet``: the peers' autoscaling view the dashboard shows (``/dashboard/fleet.json``); None: no such panel."""
    middleware = [Middleware(RequestContextMiddleware, max_body_bytes=runtime.settings.max_body_bytes),
                  Middleware(AuthMiddleware, runtime=runtime)]
    origins = runtime.settings.allowed_origins
    if origins:
        # Outermost: a browser's preflight (OPTIONS, no API key) is answered before authentication, and error
        # responses carry the CORS headers too, so the page can read them.
        middleware.insert(0, Middleware(CORSMiddleware, allow_origins=list(origins), allow_methods=["*"],
                                        allow_headers=["*"], expose_headers=EXPOSED_HEADERS))
    routes = [*OpenAIRoutes(runtime).routes(), *NativeRoutes(runtime).routes(), *StreamRoutes(runtime).routes(),
              *UtilityRoutes(runtime).routes(), *DocsRoutes().routes(), *DashboardRoutes(fleet).routes()]
    return Starlette(
        routes=routes,
        middleware=middleware,
        exception_handlers={
            APIError: api_error_handler,
            HTTPException: http_exception_handler,
            RequestError: request_error_handler,
            RtxError: _rtx_error,
            ClientGone: _client_gone,
            # The client left while its body was arriving (request.body()): as ClientGone, a 499 in the access
            # log and nothing sent, rather than a 500 with a traceback.
            ClientDisconnect: _client_gone,
        },
    )


async def _rtx_error(request: Request, exc: Exception) -> Response:
    log.error("%s %s failed: %s", request.method, loggable(request.url.path), exc)
    return APIError(500, str(exc)).response()


async def _client_gone(request: Request, exc: Exception) -> Response:
    return Response(status_code=CLIENT_CLOSED_REQUEST)
