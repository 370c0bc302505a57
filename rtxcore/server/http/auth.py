"""API-key authentication for the HTTP server: every route but the probes and ``/metrics`` needs a key when keys are
configured. The tenant found is put in the request's state for the routes; the key itself goes nowhere."""

from __future__ import annotations

from starlette.types import ASGIApp, Receive, Scope, Send

from rtxcore.server.http.errors import error_response
from rtxcore.server.serving.runtime import ServingRuntime
from rtxcore.server.serving.tenants import AuthError, presented_key

# Probes, metrics and the API description: what a load balancer, a scraper or a browser opening /docs reaches without
# a key (vLLM guards only /v1/*). /tokenize and the generation routes stay behind it.
OPEN_PATHS = frozenset({"/health", "/ready", "/metrics", "/version", "/openapi.json", "/docs"})


class AuthMiddleware:
    def __init__(self, app: ASGIApp, runtime: ServingRuntime):
        self.app = app
        self.runtime = runtime

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        tenants = self.runtime.tenants
        tenant = None
        if tenants.auth_required and scope["path"] not in OPEN_PATHS:
            headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]
                       if k.lower() in (b"authorization", b"x-api-key")}
            try:
                tenant = tenants.authenticate(presented_key(headers.get("authorization"), headers.get("x-api-key")))
            except AuthError as exc:
                self.runtime.metrics.record_rejection("unauthorized")
                response = error_response(exc, headers={"WWW-Authenticate": "Bearer", "connection": "close"})
                await response(scope, receive, send)
                return
        scope["state"] = {**scope.get("state", {}), "tenant": tenant}
        await self.app(scope, receive, send)
