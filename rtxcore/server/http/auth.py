"""Authentication for the HTTP server: every route but the probes and ``/metrics`` goes through the runtime's
authenticators when some are configured. The tenant found is put in the request's state for the routes; the
credentials go nowhere else."""

from __future__ import annotations

from starlette.types import ASGIApp, Receive, Scope, Send

from rtxcore.contracts.authenticator import Credentials
from rtxcore.errors import ErrorCode, RequestError
from rtxcore.server.http.dashboard_routes import PATHS as DASHBOARD_PATHS
from rtxcore.server.http.errors import error_response
from rtxcore.server.serving.authentication import certificate_subject
from rtxcore.server.serving.runtime import ServingRuntime

# Probes, metrics and the API description: what a load balancer, a scraper or a browser opening /docs reaches without
# a key (vLLM guards only /v1/*). /tokenize and the generation routes stay behind it.
OPEN_PATHS = frozenset({"/health", "/ready", "/metrics", "/version", "/openapi.json", "/docs", *DASHBOARD_PATHS})


class AuthMiddleware:
    def __init__(self, app: ASGIApp, runtime: ServingRuntime):
        self.app = app
        self.runtime = runtime

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        auth = self.runtime.auth
        tenant = None
        if auth.required and scope["path"] not in OPEN_PATHS:
            try:
                tenant = auth.authenticate(credentials_of(scope))
            except RequestError as exc:
                unauthenticated = exc.code is ErrorCode.UNAUTHENTICATED
                self.runtime.metrics.record_rejection("unauthorized" if unauthenticated else "auth_rate_limited")
                headers = {"connection": "close"}
                if unauthenticated:
                    headers["WWW-Authenticate"] = auth.challenge
                await error_response(exc, headers=headers)(scope, receive, send)
                return
        scope["state"] = {**scope.get("state", {}), "tenant": tenant}
        await self.app(scope, receive, send)


def credentials_of(scope: Scope) -> Credentials:
    """What an HTTP request presented: its authorization headers, the client certificate TLS verified (the ASGI TLS
    extension, which ``rtxcore.server.http.tls`` fills in) and the source address."""
    headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]
               if k.lower() in (b"authorization", b"x-api-key")}
    tls = (scope.get("extensions") or {}).get("tls") or {}
    subject = tls.get("rtx_client_cert_subject")
    if subject is None and tls.get("client_cert_chain"):  # another ASGI server's TLS extension
        subject = certificate_subject(tls["client_cert_chain"][0].encode())
    client = scope.get("client")
    return Credentials(authorization=headers.get("authorization"), api_key=headers.get("x-api-key"),
                       client_cert_subject=subject, peer=client[0] if client else None)
