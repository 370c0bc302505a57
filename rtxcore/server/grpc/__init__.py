"""The gRPC server: the ``rtx.v1.Rtx`` service of ``spec/rtx.proto``, standard health checking and reflection.

The server's names are imported on first use so that ``rtxcore.server.grpc.codegen`` (used by the client and by
``setup.py``) can be imported without loading the engine.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rtxcore.server.grpc.server import GrpcServer, start_grpc_server

__all__ = ["GrpcServer", "start_grpc_server"]


def __getattr__(name: str):
    if name in __all__:
        from rtxcore.server.grpc import server

        return getattr(server, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
