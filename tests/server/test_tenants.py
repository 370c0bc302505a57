"""Tenants: keys stored hashed and never logged, 401/403/429 with Retry-After, token buckets, concurrency caps,
and prefix-cache isolation between tenants, through a real server (HTTP and gRPC) and on the registry itself."""

from __future__ import annotations

import hashlib
import random
import threading

import grpc
import httpx
import pytest

from rtxcore.contracts.authenticator import Credentials
from rtxcore.errors import ConfigError, InvalidRequestError
from rtxcore.server.serving.authentication import Authentication, AuthError
from rtxcore.server.serving.tenants import (
    NotEntitled,
    RateLimited,
    TenantRegistry,
    TokenBucket,
    cache_salt,
)
from tests.helpers.server import start_server

KEY_A = "sk-tenant-a-" + "7f3e9c1d5b2a4e6f8091a2b3c4d5e6f7"
KEY_B = "sk-tenant-b-" + "0a1b2c3d4e5f60718293a4b5c6d7e8f9"
KEY_LIMITED = "sk-limited-" + "ffeeddccbbaa99887766554433221100"


def sha(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


# -- the registry --------------------------------------------------------------------------------------------------


def test_keys_from_file_hashes_and_environment():
    registry = TenantRegistry.from_config(
        {"a": {"key_sha256": sha(KEY_A)}, "b": {"key_env": "B_KEY", "lanes": ["bulk"]}},
        environ={"B_KEY": KEY_B, "RTX_API_KEYS": "c=" + KEY_LIMITED})
    auth = Authentication.from_config(None, registry)
    assert auth.required and [name for name, _ in auth.authenticators] == ["api-key"]
    assert auth.authenticate(Credentials(authorization=f"Bearer {KEY_A}")).name == "a"
    assert auth.authenticate(Credentials(api_key=KEY_B)).name == "b"
    assert auth.authenticate(Credentials(authorization=f"bearer  {KEY_LIMITED} ")).name == "c"
    for wrong in ("", None, KEY_A[:-1], KEY_A + "x"):
        with pytest.raises(AuthError):
            auth.authenticate(Credentials(authorization=f"Bearer {wrong}" if wrong is not None else None))
    # Nothing in memory holds a key in clear.
    assert KEY_B not in repr(registry.tenants) and KEY_B.encode() not in b"".join(
        h for t in registry.tenants.values() for h in t.key_hashes)
    assert registry.tenants["b"].default_lane == "bulk"
    with pytest.raises(NotEntitled, match="not entitled to the realtime lane"):
        registry.tenants["b"].lane_for("realtime")


def test_no_keys_means_unauthenticated():
    auth = Authentication.from_config(None, TenantRegistry.from_config(None, environ={}))
    assert not auth.required and auth.authenticate(Credentials()) is None


@pytest.mark.parametrize("table, message", [
    ({"a": {"key": "x"}}, "keys are never written in clear"),
    ({"a": {"key_env": "MISSING"}}, "'MISSING', which is not set"),
    ({"a": {"key_sha256": "abc"}}, "64-character hex"),
    ({"a": {"key_sha256": sha("k"), "lanes": ["gold"]}}, "unknown lane 'gold'"),
    ({"a": {"key_sha256": sha("k"), "lanes": []}}, "lanes is empty"),
    ({"a b": {"key_sha256": sha("k")}}, "tenant name"),
    ({"a": {"key_sha256": sha("k"), "requests_per_second": -1}}, "positive number"),
    ({"a": {"key_sha256": sha("k"), "tokens_per_minute": float("nan")}}, "positive integer"),
    ({"a": {"key_sha256": sha("k"), "lanes": 5}}, "lanes must be a string or a list of strings"),
    ({"a": {"key_sha256": sha("k")}, "b": {"key_sha256": sha("k")}}, "tenants 'a' and 'b' have the same key"),
])
def test_config_errors_name_the_problem(table, message):
    with pytest.raises(ConfigError, match=message):
        TenantRegistry.from_config(table, environ={})


def test_a_tenant_without_a_key_needs_an_authenticator_that_proves_it_otherwise():
    registry = TenantRegistry.from_config({"a": {}}, environ={})
    with pytest.raises(ConfigError, match="tenant 'a' has no key"):
        Authentication.from_config(None, registry)


def test_env_key_errors_do_not_echo_the_key():
    with pytest.raises(ConfigError) as exc:
        TenantRegistry.from_config(None, environ={"RTX_API_KEYS": "no-equals-" + KEY_A})
    assert KEY_A not in str(exc.value)


def test_request_bucket_burst_then_retry_after():
    registry = TenantRegistry.from_config({"a": {"key_sha256": sha(KEY_A), "requests_per_second": 2, "burst": 3}},
                                          environ={})
    tenant = registry.tenants["a"]
    leases = [registry.acquire(tenant, 1, 10) for _ in range(3)]
    with pytest.raises(RateLimited) as exc:
        registry.acquire(tenant, 1, 10)
    assert exc.value.limit == "requests_per_second" and 0 < exc.value.retry_after_s <= 0.5 + 1e-6
    for lease in leases:
        registry.release(lease, 10)


def test_token_bucket_refunds_what_was_not_generated():
    registry = TenantRegistry.from_config({"a": {"key_sha256": sha(KEY_A), "tokens_per_minute": 100}}, environ={})
    tenant = registry.tenants["a"]
    lease = registry.acquire(tenant, 1, 80)  # prompt + max_tokens reserved
    with pytest.raises(RateLimited) as exc:
        registry.acquire(tenant, 1, 30)
    assert exc.value.limit == "tokens_per_minute" and exc.value.retry_after_s > 0
    registry.release(lease, 20)  # it used 20 of the 80
    registry.release(registry.acquire(tenant, 1, 30), 30)
    with pytest.raises(InvalidRequestError, match="more than tenant 'a'") as too_large:
        registry.acquire(tenant, 1, 101)
    assert too_large.value.param == "max_tokens"


def test_concurrency_cap():
    registry = TenantRegistry.from_config({"a": {"key_sha256": sha(KEY_A), "max_concurrency": 2}}, environ={})
    tenant = registry.tenants["a"]
    first, second = registry.acquire(tenant, 1, 1), registry.acquire(tenant, 1, 1)
    with pytest.raises(RateLimited, match="2 concurrent") as exc:
        registry.acquire(tenant, 1, 1)
    assert exc.value.limit == "concurrency"
    registry.release(first, 1)
    registry.release(first, 1)  # twice is harmless
    registry.acquire(tenant, 1, 1)
    assert second is not None


@pytest.mark.parametrize("limits", [{"max_concurrency": 2}, {"requests_per_second": 1, "burst": 2}])
def test_more_prompts_than_a_limit_allows_is_invalid_not_rate_limited(limits):
    registry = TenantRegistry.from_config({"a": {"key_sha256": sha(KEY_A), **limits}}, environ={})
    tenant = registry.tenants["a"]
    # No wait lets it through: a 429 would have clients retry it for ever (and an infinite Retry-After was a 500).
    with pytest.raises(InvalidRequestError, match=r"request runs 3 sequences \(prompts x n\), more than tenant 'a'") \
            as exc:
        registry.acquire(tenant, 3, 3)
    assert exc.value.param == "prompt"
    # One prompt with n=3 blames n, which the client sent (it used to name the prompt).
    with pytest.raises(InvalidRequestError) as exc:
        registry.acquire(tenant, 3, 3, requests_param="n")
    assert exc.value.param == "n"
    registry.release(registry.acquire(tenant, 2, 2), 2)


def test_embeddings_over_the_token_limit_blame_their_input():
    registry = TenantRegistry.from_config({"a": {"key_sha256": sha(KEY_A), "tokens_per_minute": 100}}, environ={})
    with pytest.raises(InvalidRequestError, match=r"needs 800 tokens \(inputs\)") as exc:
        registry.acquire(registry.tenants["a"], 1, 800, tokens_param="input", tokens_what="inputs")
    assert exc.value.param == "input"


def test_bucket_refills_at_its_rate():
    bucket = TokenBucket(rate=10.0, capacity=5.0, updated=0.0)
    bucket.take(5)
    assert bucket.wait_for(1, 0.0) == pytest.approx(0.1)
    assert bucket.wait_for(1, 0.1) == pytest.approx(0.0)
    assert bucket.wait_for(6, 1.0) == float("inf")


def test_cache_salt_separates_tenants_and_salts():
    registry = TenantRegistry.from_config({"a": {"key_sha256": sha(KEY_A)}, "b": {"key_sha256": sha(KEY_B)}},
                                          environ={})
    a, b = registry.tenants["a"], registry.tenants["b"]
    salts = {cache_salt(a, None), cache_salt(b, None), cache_salt(a, "x"), cache_salt(None, "x"),
             cache_salt(None, None)}
    assert len(salts) == 5 and cache_salt(a, None) == cache_salt(a, None)


# -- through a server ----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tenant_server(tmp_path_factory):
    config = tmp_path_factory.mktemp("tenants") / "serve.toml"
    config.write_text(f"""
[tenants.alpha]
key_sha256 = "{sha(KEY_A)}"

[tenants.beta]
key_env = "BETA_KEY"
lanes = ["standard", "bulk"]

[tenants.limited]
key_sha256 = "{sha(KEY_LIMITED)}"
requests_per_second = 0.2
burst = 2
max_concurrency = 4
tokens_per_minute = 100000
""")
    server = start_server("--model", "dummy:tiny", "--scheduler", "sla-lanes", "--config", str(config),
                          "--log-level", "debug", env={"BETA_KEY": KEY_B})
    yield server
    server.stop()


def _complete(server, key: str | None, prompt, **body):
    headers = {"authorization": f"Bearer {key}"} if key else {}
    return httpx.post(f"{server.base_url}/v1/completions", headers=headers, timeout=60,
                      json={"prompt": prompt, "max_tokens": 2, "temperature": 0, **body})


def test_missing_or_wrong_key_is_401(tenant_server):
    for key in (None, "sk-wrong", KEY_A[:-1]):
        r = _complete(tenant_server, key, [1, 2, 3])
        assert r.status_code == 401, r.text
        assert r.json()["error"]["code"] == "invalid_api_key" and r.headers["www-authenticate"] == "Bearer"
        assert r.json()["error"]["message"] in ("invalid credentials", "missing credentials: send "
                                                "'Authorization: Bearer <key or token>'")
    r = httpx.get(f"{tenant_server.base_url}/v1/models", headers={"x-api-key": "nope"})
    assert r.status_code == 401
    # Probes and metrics stay open for Kubernetes and Prometheus.
    assert httpx.get(f"{tenant_server.base_url}/health").status_code == 200
    assert httpx.get(f"{tenant_server.base_url}/metrics").status_code == 200
    assert _complete(tenant_server, KEY_A, [1, 2, 3]).status_code == 200
    assert httpx.get(f"{tenant_server.base_url}/v1/models", headers={"x-api-key": KEY_A}).status_code == 200


def test_lane_entitlement_is_403(tenant_server):
    r = _complete(tenant_server, KEY_B, [1, 2, 3], lane="realtime")
    assert r.status_code == 403 and "not entitled to the realtime lane" in r.json()["error"]["message"]
    r = httpx.post(f"{tenant_server.base_url}/v1/completions", timeout=60,
                   headers={"authorization": f"Bearer {KEY_B}", "x-rtx-lane": "bulk"},
                   json={"prompt": [1, 2], "max_tokens": 2})
    assert r.status_code == 200
    r = _complete(tenant_server, KEY_A, [1, 2, 3], lane="platinum")
    assert r.status_code == 400 and r.json()["error"]["param"] == "lane"


def test_rate_limit_is_429_with_retry_after(tenant_server):
    statuses = [_complete(tenant_server, KEY_LIMITED, [4, 5, 6]) for _ in range(3)]
    assert [r.status_code for r in statuses[:2]] == [200, 200]
    refused = statuses[2]
    assert refused.status_code == 429, refused.text
    assert refused.json()["error"]["code"] == "rate_limited"
    assert "requests per second" in refused.json()["error"]["message"]
    assert 1 <= int(refused.headers["retry-after"]) <= 5  # 0.2 req/s: the next one is at most 5 s away


def test_a_request_larger_than_a_limit_is_400_over_http_and_invalid_argument_over_grpc(tenant_server):
    from rtxcore._generated import rtx_pb2, rtx_pb2_grpc

    r = _complete(tenant_server, KEY_LIMITED, [[4, 5], [6, 7], [8, 9], [1, 2], [3, 4]])  # 5 prompts, 4 at most
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt" and "retry-after" not in r.headers
    with grpc.insecure_channel(tenant_server.grpc_target) as channel:
        request = rtx_pb2.GenerateRequest(token_ids=rtx_pb2.TokenIds(ids=[1, 2, 3]), max_tokens=200_000)
        with pytest.raises(grpc.RpcError) as exc:
            list(rtx_pb2_grpc.RtxStub(channel).Generate(
                request, metadata=(("authorization", f"Bearer {KEY_LIMITED}"),), timeout=30))
        assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "tokens per minute" in exc.value.details()


def test_tenants_never_share_prefix_cache_blocks(tenant_server):
    prompt = random.Random(7).sample(range(100, 500), 40)  # 2 full blocks of 16, never seen before
    first_a = _complete(tenant_server, KEY_A, prompt).json()["usage"]
    b = _complete(tenant_server, KEY_B, prompt).json()["usage"]
    second_a = _complete(tenant_server, KEY_A, prompt).json()["usage"]
    assert first_a["prompt_tokens_details"]["cached_tokens"] == 0
    assert b["prompt_tokens_details"]["cached_tokens"] == 0  # A's blocks are invisible to B
    assert second_a["prompt_tokens_details"]["cached_tokens"] == 32  # A's own blocks do hit
    # A per-request salt splits one tenant's cache too.
    salted = _complete(tenant_server, KEY_A, prompt, cache_salt="doc-42").json()["usage"]
    assert salted["prompt_tokens_details"]["cached_tokens"] == 0


def test_grpc_needs_the_key_too(tenant_server):
    from rtxcore._generated import rtx_pb2, rtx_pb2_grpc

    with grpc.insecure_channel(tenant_server.grpc_target) as channel:
        stub = rtx_pb2_grpc.RtxStub(channel)
        request = rtx_pb2.GenerateRequest(token_ids=rtx_pb2.TokenIds(ids=[1, 2, 3]), max_tokens=2)
        with pytest.raises(grpc.RpcError) as exc:
            list(stub.Generate(request, metadata=(("authorization", "Bearer sk-wrong"),), timeout=30))
        assert exc.value.code() == grpc.StatusCode.UNAUTHENTICATED
        with pytest.raises(grpc.RpcError) as exc:
            list(stub.Generate(request, metadata=(("authorization", f"Bearer {KEY_B}"), ("x-rtx-lane", "realtime")),
                               timeout=30))
        assert exc.value.code() == grpc.StatusCode.PERMISSION_DENIED
        outputs = list(stub.Generate(request, metadata=(("authorization", f"Bearer {KEY_A}"),), timeout=30))
        assert outputs[-1].finished


def test_keys_never_reach_logs_or_metrics(tenant_server):
    # Exercise failures and successes with every key, concurrently, then scan everything the server emitted.
    threads = [threading.Thread(target=_complete, args=(tenant_server, key, [9, 8, 7]))
               for key in (KEY_A, KEY_B, KEY_LIMITED, KEY_A + "-wrong", "sk-" + KEY_B)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    metrics = httpx.get(f"{tenant_server.base_url}/metrics").text
    assert 'tenant="alpha"' in metrics and 'outcome="admitted"' in metrics
    emitted = tenant_server.stdout + tenant_server.stderr + metrics
    assert "request_finished" in emitted  # the debug log did record requests
    for secret in (KEY_A, KEY_B, KEY_LIMITED, sha(KEY_A), sha(KEY_B), sha(KEY_LIMITED)):
        assert secret not in emitted
        assert secret[:16] not in emitted
