"""Run the servers: HTTP (uvicorn) and gRPC over one runtime, on one event loop, with a graceful drain on SIGINT and
SIGTERM. The engine steps on a thread of its own; the model loads on another.

The order of a start: bind the HTTP socket (a busy port is a one-line error), start gRPC, start answering, then
load the model in the background; probes answer at once and model routes say 503 until it is loaded.

The order of a stop, on the first SIGINT or SIGTERM: mark the runtime draining (new requests get 503), wait up to
``shutdown_grace_s`` for running requests to finish, then stop uvicorn, gRPC and the engine, and flush and close the
request journal (with a state dir). A second signal skips the wait.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import signal
import socket
import sys
import time
from typing import TYPE_CHECKING, Iterator, TextIO

import uvicorn

from rtxcore.errors import RtxError
from rtxcore.server.fleet import FleetWatcher
from rtxcore.server.http import build_app
from rtxcore.server.http.tls import uvicorn_tls_options
from rtxcore.server.serving.proxies import DEFAULT_TRUSTED, TrustedProxies
from rtxcore.server.serving.recovery import recover
from rtxcore.server.serving.runtime import ServingRuntime

if TYPE_CHECKING:
    from rtxcore.server.grpc.server import GrpcServer

log = logging.getLogger("rtx.server")

_DRAIN_POLL_S = 0.05


class _UvicornServer(uvicorn.Server):
    """uvicorn without its own signal handlers: the launcher drains before asking it to exit."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


class _ShutdownCutFilter(logging.Filter):
    """Once the grace period is over, uvicorn cancels the responses still sending and logs each at ERROR with a
    traceback ("Exception in ASGI application"), as it would a crash. That cut is the documented end of a drain,
    already said in one warning: those records are dropped, nothing else."""

    def __init__(self) -> None:
        super().__init__()
        self.cutting = False

    def filter(self, record: logging.LogRecord) -> bool:
        if not self.cutting:
            return True
        cancelled = record.exc_info is not None and isinstance(record.exc_info[1], asyncio.CancelledError)
        return not (cancelled or "timeout graceful shutdown exceeded" in record.getMessage())


class Launcher:
    def __init__(self, runtime: ServingRuntime, out: TextIO = sys.stdout):
        self.runtime = runtime
        self.settings = runtime.settings
        self.out = out
        self._stop_requested: asyncio.Event | None = None
        self._server: _UvicornServer | None = None
        self._num_signals = 0
        self._cut_filter = _ShutdownCutFilter()

    def run(self) -> int:
        """Serve until a signal; returns the exit code. :raises RtxError: the port is taken or the model failed."""
        sock = _bind(self.settings.host, self.settings.port)
        uvicorn_log = logging.getLogger("uvicorn.error")
        uvicorn_log.addFilter(self._cut_filter)
        try:
            return asyncio.run(self._serve(sock))
        finally:
            uvicorn_log.removeFilter(self._cut_filter)
            sock.close()

    async def _serve(self, sock: socket.socket) -> int:
        loop = asyncio.get_running_loop()
        self._stop_requested = asyncio.Event()
        fleet = self._fleet_watcher()
        config = uvicorn.Config(build_app(self.runtime, fleet), log_level="warning", access_log=False, lifespan="off",
                                timeout_graceful_shutdown=max(1, math.ceil(self.settings.shutdown_grace_s)),
                                forwarded_allow_ips=TrustedProxies(self.settings.forwarded_allow_ips
                                                                   or DEFAULT_TRUSTED).for_uvicorn(),
                                **uvicorn_tls_options(self.settings.tls))
        self._server = server = _UvicornServer(config)
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, self._on_signal, sig)
        grpc = await self._start_grpc()
        serving = asyncio.ensure_future(server.serve(sockets=[sock]))
        address = self._address(sock.getsockname()[1], grpc)
        fleet_task: asyncio.Future | None = None
        try:
            await self._until_started(server, serving)
            if fleet is not None:
                fleet_task = asyncio.ensure_future(fleet.run(sock.getsockname()[1]))
            self._say(f"listening on {address}; loading model {self.runtime.model_name}...")
            self.runtime.start_loading()
            if await _first(self._wait_loaded(), self._stop_requested.wait(), serving) == 0:
                if self.runtime.load_error is not None:
                    raise _load_failure(self.runtime.load_error)
                await recover(self.runtime)  # before "ready": a resumed stream must be found when asked for
                self._say(f"{address} model={self.runtime.model_name} backend={self.runtime.backend_name}")
                await _first(self._stop_requested.wait(), serving)
            if not serving.done():
                await self._drain(server)
        finally:
            if fleet_task is not None:
                fleet_task.cancel()
            server.should_exit = True
            await asyncio.gather(serving, *([fleet_task] if fleet_task else []), return_exceptions=True)
            if self.runtime.durable is not None:
                # Past the grace period: what still runs stays unfinished in the journal, for the next start. Before
                # the gRPC server stops, so that its calls following such requests end saying to resume them.
                await self.runtime.durable.stop_producers()
            if grpc is not None:
                await grpc.stop(1.0)
            self.runtime.stop()
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.remove_signal_handler(sig)
        if not serving.cancelled() and serving.exception() is not None:
            raise RtxError(f"the HTTP server failed: {serving.exception()}")
        self._say("stopped")
        return 0

    def _fleet_watcher(self) -> FleetWatcher | None:
        fleet, tls = self.settings.fleet, self.settings.tls
        if fleet is None:
            return None
        return FleetWatcher(fleet, (tls.certfile, tls.keyfile) if tls is not None else None)

    @staticmethod
    async def _until_started(server: uvicorn.Server, serving: asyncio.Future) -> None:
        while not server.started:
            if serving.done():
                raise RtxError(f"the HTTP server failed to start: {serving.exception()}")
            await asyncio.sleep(0.01)

    async def _wait_loaded(self) -> None:
        # Polled rather than waited on in a worker thread, which would hold up the exit of a server stopped while
        # it loads.
        while not self.runtime.wait_loaded(0):
            await asyncio.sleep(_DRAIN_POLL_S)

    async def _drain(self, server: uvicorn.Server) -> None:
        runtime = self.runtime
        runtime.draining = True
        deadline = time.monotonic() + self.settings.shutdown_grace_s
        if runtime.num_active:
            self._say(f"draining {runtime.num_active} active requests (up to {self.settings.shutdown_grace_s:g}s)")
        while runtime.num_active and time.monotonic() < deadline and self._num_signals < 2:
            await asyncio.sleep(_DRAIN_POLL_S)
        if runtime.num_active:
            journaled = "; the journal keeps them for the next start" if runtime.durable is not None else ""
            log.warning("shutting down with %d requests still running: their streams are cut%s",
                        runtime.num_active, journaled)
            self._cut_filter.cutting = True
        # What is left is responses sending their last bytes (or, past the grace period, being cut).
        server.config.timeout_graceful_shutdown = max(1, math.ceil(deadline - time.monotonic()))

    def _on_signal(self, sig: int) -> None:
        self._num_signals += 1
        log.info("received %s", signal.Signals(sig).name)
        assert self._stop_requested is not None and self._server is not None
        self._stop_requested.set()
        if self._num_signals > 1:  # a second signal: stop now, cutting running requests
            self._cut_filter.cutting = True
            self._server.force_exit = True

    async def _start_grpc(self) -> GrpcServer | None:
        if self.settings.grpc_port is None:
            return None
        from rtxcore.server.grpc.server import start_grpc_server  # generates the gRPC modules on first use

        try:
            return await start_grpc_server(self.runtime, self.settings.host, self.settings.grpc_port,
                                           self.settings.tls)
        except OSError as exc:
            raise RtxError(str(exc)) from None

    def _address(self, http_port: int, grpc: GrpcServer | None) -> str:
        host = self.settings.host
        shown = f"[{host}]" if ":" in host else host
        address = f"{'https' if self.settings.tls else 'http'}://{shown}:{http_port}"
        return address + (f" (grpc {shown}:{grpc.port})" if grpc is not None else "")

    def _say(self, line: str) -> None:
        self.out.write(f"rtx serve: {line}\n")
        self.out.flush()


def _bind(host: str, port: int) -> socket.socket:
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        sock = socket.socket(family, kind, proto)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
    except OSError as exc:
        raise RtxError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    sock.set_inheritable(True)
    return sock


async def _first(*aws) -> int:
    """Wait until the first of ``aws`` is done and return its position; coroutines passed in are cancelled, futures
    are left to their owner."""
    tasks = [asyncio.ensure_future(a) for a in aws]
    done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    for task, aw in zip(tasks, aws):
        if task is not aw and task not in done:
            task.cancel()
    return next(i for i, task in enumerate(tasks) if task in done)


def _load_failure(exc: BaseException) -> RtxError:
    if isinstance(exc, RtxError):
        return exc
    return RtxError(f"the model failed to load: {type(exc).__name__}: {exc}")


def serve(runtime: ServingRuntime, out: TextIO = sys.stdout) -> int:
    return Launcher(runtime, out).run()
