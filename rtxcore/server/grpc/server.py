"""Run the gRPC server on the servers' event loop (the one uvicorn runs on), so that a call reaches the serving core
and the request journal without crossing threads; the engine keeps its own thread.

Beside ``rtx.v1.Rtx`` it serves the standard ``grpc.health.v1.Health`` service, SERVING once the runtime is ready
and NOT_SERVING while loading or draining, and server reflection so tools such as grpcurl need no proto file.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from rtxcore.server.grpc.servicer import SERVICE_NAME, RtxServicer, rtx_pb2_grpc
from rtxcore.server.serving.runtime import ServingRuntime
from rtxcore.server.serving.settings import TlsSettings

log = logging.getLogger("rtx.server.grpc")

# How often the health status follows the runtime (loading -> ready -> draining).
HEALTH_POLL_S = 0.5


class GrpcServer:
    """A gRPC server started on the running event loop: :attr:`port` is the bound port (useful with port 0)."""

    def __init__(self, server: grpc.aio.Server, health_servicer: health.aio.HealthServicer, port: int,
                 runtime: ServingRuntime):
        self.port = port
        self._server = server
        self._health = health_servicer
        self._runtime = runtime
        self._watch = asyncio.ensure_future(self._follow_health())

    async def stop(self, grace_s: float | None = None) -> None:
        """Stop accepting calls, let running ones finish for ``grace_s`` seconds (None: cancel them at once), then
        cancel what is left."""
        self._watch.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._watch
        await _set_health(self._health, False)
        await self._server.stop(grace_s)

    async def _follow_health(self) -> None:
        serving: bool | None = None
        while True:
            if serving is not self._runtime.ready:
                serving = self._runtime.ready
                await _set_health(self._health, serving)
            await asyncio.sleep(HEALTH_POLL_S)


async def start_grpc_server(runtime: ServingRuntime, host: str = "127.0.0.1", port: int = 50051,
                            tls: TlsSettings | None = None) -> GrpcServer:
    """Start serving on ``host:port`` (port 0 picks a free one) on the running event loop, over TLS with ``tls``
    (client certificates required and verified when it says so).

    :raises OSError: the port cannot be bound.
    """
    # Without SO_REUSEPORT a second server on a taken port fails instead of silently sharing it. A request may be
    # as large as an HTTP body (--max-body-bytes), not gRPC's default 4 MiB: gRPC refuses a larger one itself, with
    # RESOURCE_EXHAUSTED and no retry-after (which the clients do not retry).
    server = grpc.aio.server(options=(("grpc.so_reuseport", 0),
                                      ("grpc.max_receive_message_length", runtime.settings.max_body_bytes)))
    rtx_pb2_grpc.add_RtxServicer_to_server(RtxServicer(runtime), server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(
        (SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME), server)
    address = f"{host}:{port}"
    try:
        if tls is None:
            bound = server.add_insecure_port(address)
        else:
            key, chain, ca = tls.read()
            bound = server.add_secure_port(address, grpc.ssl_server_credentials(
                [(key, chain)], root_certificates=ca, require_client_auth=tls.cert_reqs == "required"))
    except RuntimeError as exc:
        raise OSError(f"gRPC server cannot listen on {address} ({_bind_hint(tls)}): {exc}") from None
    if bound == 0:  # older grpcio reports a failed bind this way instead of raising
        raise OSError(f"gRPC server cannot listen on {address} ({_bind_hint(tls)})")
    await server.start()
    log.info("gRPC server listening on %s:%d", host, bound)
    return GrpcServer(server, health_servicer, bound, runtime)


def _bind_hint(tls: TlsSettings | None) -> str:
    # gRPC reports credentials it cannot use as a failed bind. TlsSettings loads the files first, so that is
    # unlikely, but the port is then not the only suspect.
    return "is the port in use?" if tls is None else "is the port in use, or are the TLS files ones gRPC refuses?"


async def _set_health(servicer: health.aio.HealthServicer, serving: bool) -> None:
    status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
    for service in ("", SERVICE_NAME):  # "" is the whole server
        await servicer.set(service, status)
