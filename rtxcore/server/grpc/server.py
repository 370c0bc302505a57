"""Run the gRPC server on a thread of its own with its own event loop (uvicorn has the main one).

Beside ``rtx.v1.Rtx`` it serves the standard ``grpc.health.v1.Health`` service, SERVING once the runtime is ready
and NOT_SERVING while loading or draining, and server reflection so tools such as grpcurl need no proto file.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from rtxcore.server.grpc.servicer import SERVICE_NAME, RtxServicer, rtx_pb2_grpc
from rtxcore.server.runtime import ServingRuntime

log = logging.getLogger("rtx.server.grpc")

# How often the health status follows the runtime (loading -> ready -> draining).
HEALTH_POLL_S = 0.5


class GrpcServerHandle:
    """A running server: :attr:`port` is the bound port (useful with port 0), :meth:`stop` shuts it down."""

    def __init__(self, runtime: ServingRuntime, host: str, port: int):
        self.runtime = runtime
        self.host = host
        self.port = 0
        self._requested_port = port
        self._loop = asyncio.new_event_loop()
        self._started: concurrent.futures.Future[int] = concurrent.futures.Future()
        self._stop_requested: asyncio.Event | None = None
        self._grace_s: float | None = None
        self._thread = threading.Thread(target=self._run, name="rtx-grpc", daemon=True)

    def start(self) -> None:
        self._thread.start()
        self.port = self._started.result()  # re-raises a bind failure in the caller's thread

    def stop(self, grace_s: float | None = None, timeout_s: float | None = None) -> None:
        """Stop accepting calls, let running ones finish for ``grace_s`` seconds (None: cancel them at once), then
        cancel what is left; returns once the server thread is gone."""
        if not self._thread.is_alive():
            return
        self._grace_s = grace_s
        self._loop.call_soon_threadsafe(self._stop_requested.set)
        self._thread.join(timeout_s if timeout_s is not None else (grace_s or 0) + 10)

    # -- the server thread ----------------------------------------------------------------------------------------

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        try:
            self._loop.run_until_complete(self._serve())
        except BaseException as exc:
            if not self._started.done():
                self._started.set_exception(exc)
            else:
                log.exception("gRPC server failed")
        finally:
            self._loop.close()

    async def _serve(self) -> None:
        self._stop_requested = asyncio.Event()
        # Without SO_REUSEPORT a second server on a taken port fails instead of silently sharing it.
        server = grpc.aio.server(options=(("grpc.so_reuseport", 0),))
        rtx_pb2_grpc.add_RtxServicer_to_server(RtxServicer(self.runtime), server)
        health_servicer = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
        reflection.enable_server_reflection(
            (SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME),
            server)
        address = f"{self.host}:{self._requested_port}"
        try:
            port = server.add_insecure_port(address)
        except RuntimeError as exc:
            raise OSError(f"gRPC server cannot listen on {address} (is the port in use?): {exc}") from None
        if port == 0:  # older grpcio reports a failed bind this way instead of raising
            raise OSError(f"gRPC server cannot listen on {address} (is the port in use?)")
        await server.start()
        log.info("gRPC server listening on %s:%d", self.host, port)
        self._started.set_result(port)

        serving: bool | None = None
        while not self._stop_requested.is_set():
            if serving is not self.runtime.ready:
                serving = self.runtime.ready
                await _set_health(health_servicer, serving)
            try:
                await asyncio.wait_for(self._stop_requested.wait(), HEALTH_POLL_S)
            except TimeoutError:
                pass
        await _set_health(health_servicer, False)
        await server.stop(self._grace_s)


async def _set_health(servicer: health.aio.HealthServicer, serving: bool) -> None:
    status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
    for service in ("", SERVICE_NAME):  # "" is the whole server
        await servicer.set(service, status)


def start_grpc_server(runtime: ServingRuntime, host: str = "127.0.0.1", port: int = 50051) -> GrpcServerHandle:
    """Start serving on ``host:port`` (port 0 picks a free one; read it from the handle's ``port``)."""
    handle = GrpcServerHandle(runtime, host, port)
    handle.start()
    return handle
