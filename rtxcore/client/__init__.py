"""Python clients of rtx-serve: HTTP (OpenAI-compatible and native routes) and gRPC, each sync and async.

All of them share one retry policy (:class:`RetryPolicy`: bounded attempts honouring ``Retry-After`` on 429/503 or
RESOURCE_EXHAUSTED/UNAVAILABLE) and raise :class:`APIError` for what the server refused.
"""

from rtxcore.client.errors import APIConnectionError, APIError, APITimeoutError
from rtxcore.client.grpc import AsyncGrpcClient, GrpcClient
from rtxcore.client.http import AsyncClient, Client
from rtxcore.client.retry import NO_RETRY, RetryPolicy

__all__ = ["APIConnectionError", "APIError", "APITimeoutError", "AsyncClient", "AsyncGrpcClient", "Client",
           "GrpcClient", "NO_RETRY", "RetryPolicy"]
