"""A real gRPC server in the test process: ``rtx serve`` runs it on its servers' event loop; here that loop runs on a
thread of its own so that tests can call the server with blocking stubs.

    server = ThreadedGrpcServer(runtime)     # serving on 127.0.0.1:server.port
    server.stop(grace_s=0)
"""

from __future__ import annotations

import asyncio
import threading
from typing import Any, Coroutine, TypeVar

from rtxcore.server.grpc.server import start_grpc_server
from rtxcore.server.serving.runtime import ServingRuntime

T = TypeVar("T")


class ThreadedGrpcServer:
    def __init__(self, runtime: ServingRuntime, host: str = "127.0.0.1", port: int = 0):
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="test-grpc-loop", daemon=True)
        self._thread.start()
        try:
            self._server = self._run(start_grpc_server(runtime, host, port))
        except BaseException:
            self._close_loop()
            raise
        self.port = self._server.port

    def stop(self, grace_s: float | None = None) -> None:
        if self._thread.is_alive():
            self._run(self._server.stop(grace_s))
            self._close_loop()

    def _run(self, coro: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(30)

    def _close_loop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
