"""The gRPC clients against in-process servers set up for one thing each: one that admits a single request (retries
honour retry-after), one with a tenant and a 64 KiB message limit (API key, lane and metadata; a request over the
limit is not retried)."""

from __future__ import annotations

import asyncio
import hashlib
import threading
import time

import pytest

from rtxcore.client import NO_RETRY, APIError, AsyncGrpcClient, GrpcClient, RetryPolicy
from rtxcore.client.retry import is_retryable
from rtxcore.engine.config import EngineConfig
from rtxcore.server.serving.runtime import ServeSettings, ServingRuntime
from rtxcore.server.serving.tenants import TenantRegistry
from tests.helpers.grpc_server import ThreadedGrpcServer


def in_process_grpc_server(settings: ServeSettings, tenants: TenantRegistry | None = None):
    """A gRPC server in this process on the tiny random model (token-id prompts): yields its target."""
    runtime = ServingRuntime(EngineConfig(model="dummy:tiny"), settings, tenants=tenants)
    runtime.load()
    server = ThreadedGrpcServer(runtime)
    yield f"127.0.0.1:{server.port}"
    server.stop(grace_s=0)
    runtime.stop()


@pytest.fixture(scope="module")
def full_grpc_server():
    """An in-process gRPC server that admits one request at a time."""
    yield from in_process_grpc_server(ServeSettings(grpc_port=0, max_active_requests=1))


def test_grpc_retry_honours_retry_after_when_full(full_grpc_server):
    with GrpcClient(full_grpc_server) as client:
        holder = client.generate(list(range(10, 90)), max_tokens=1900, ignore_eos=True)
        next(holder)  # the only slot is taken

        with GrpcClient(full_grpc_server, retry=NO_RETRY) as impatient, pytest.raises(APIError) as info:
            next(impatient.generate([5, 6, 7], max_tokens=2))
        assert (info.value.code, info.value.retry_after) == ("RESOURCE_EXHAUSTED", 1.0)

        threading.Timer(0.3, holder.close).start()  # the slot frees while the client waits out Retry-After
        start = time.monotonic()
        responses = list(client.generate([5, 6, 7], max_tokens=2, temperature=0.0))
        assert responses[-1].finished
        assert time.monotonic() - start >= 1.0


def test_async_grpc_retry_honours_retry_after_when_full(full_grpc_server):
    async def main():
        async with AsyncGrpcClient(full_grpc_server) as client:
            holder = client.generate(list(range(10, 90)), max_tokens=1900, ignore_eos=True)
            await anext(holder)
            asyncio.get_running_loop().call_later(0.3, lambda: asyncio.ensure_future(holder.aclose()))
            start = time.monotonic()
            embedded = await client.embed([[5, 6, 7]])
            return embedded, time.monotonic() - start

    embedded, elapsed = asyncio.run(main())
    assert len(embedded.embeddings) == 1
    assert elapsed >= 1.0




KEY = "sk-grpc-client-" + "5e0c4b7a9d2f4e1a8b3c6d9e0f1a2b3c"


@pytest.fixture(scope="module")
def tenant_grpc_server():
    """An in-process gRPC server with one tenant, entitled to the bulk and standard lanes, and a 64 KiB limit on a
    request's size."""
    tenants = TenantRegistry.from_config(
        {"a": {"key_sha256": hashlib.sha256(KEY.encode()).hexdigest(), "lanes": ["bulk", "standard"]}}, environ={})
    yield from in_process_grpc_server(ServeSettings(grpc_port=0, max_body_bytes=64 << 10), tenants)


def test_grpc_clients_send_the_api_key_lane_and_metadata(tenant_grpc_server):
    with GrpcClient(tenant_grpc_server, retry=NO_RETRY) as anonymous, pytest.raises(APIError) as info:
        list(anonymous.generate([5, 6, 7], max_tokens=2))
    assert info.value.code == "UNAUTHENTICATED"
    with GrpcClient(tenant_grpc_server, api_key=KEY, lane="bulk") as client:
        assert list(client.generate([5, 6, 7], max_tokens=2))[-1].finished
        # The call's lane replaces the client's: realtime is not this tenant's, and the refusal names the lane.
        with pytest.raises(APIError) as info:
            list(client.generate([5, 6, 7], max_tokens=2, lane="realtime"))
        assert info.value.code == "PERMISSION_DENIED" and "realtime" in str(info.value)
        with pytest.raises(APIError) as info:
            list(client.generate([5, 6, 7], max_tokens=2, metadata=[("x-rtx-lane", "realtime")]))
        assert info.value.code == "PERMISSION_DENIED"
        assert len(client.embed([[5, 6, 7]]).embeddings) == 1
    with GrpcClient(tenant_grpc_server, metadata=[("authorization", f"Bearer {KEY}")]) as by_metadata:
        assert list(by_metadata.generate([5, 6, 7], max_tokens=2))[-1].finished
    with pytest.raises(ValueError, match="lowercase key"):
        GrpcClient(tenant_grpc_server, metadata=[("Authorization", KEY)])

    async def main():
        async with AsyncGrpcClient(tenant_grpc_server, api_key=KEY) as client:
            texts = [r async for r in client.generate([5, 6, 7], max_tokens=2, lane="standard")]
            return texts[-1].finished, len((await client.embed([[5, 6]])).embeddings)

    assert asyncio.run(main()) == (True, 1)


def test_a_request_over_the_size_limit_is_refused_not_retried(tenant_grpc_server):
    """gRPC's own size limit answers RESOURCE_EXHAUSTED with no retry-after: that is not worth a retry. The limit is
    the server's --max-body-bytes, not gRPC's 4 MiB default."""
    patient = RetryPolicy(max_attempts=3, backoff_s=5.0)  # a retry would wait 2.5 s at least
    with GrpcClient(tenant_grpc_server, api_key=KEY, retry=patient) as client:
        started = time.monotonic()
        with pytest.raises(APIError) as info:
            list(client.generate("x" * (100 << 10), max_tokens=2))
        assert info.value.code == "RESOURCE_EXHAUSTED" and info.value.retry_after is None
        assert time.monotonic() - started < 2.5, "it was retried"
        # Under 64 KiB the request reaches the server, which finds it longer than the model's context.
        with pytest.raises(APIError) as info:
            list(client.generate("x " * (20 << 10), max_tokens=2))
        assert info.value.code == "INVALID_ARGUMENT", info.value
    assert not is_retryable(APIError("Received message larger than max", code="RESOURCE_EXHAUSTED"))
    assert is_retryable(APIError("queue full", code="RESOURCE_EXHAUSTED", retry_after=1.0))
