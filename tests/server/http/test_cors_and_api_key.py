"""``--allowed-origins`` (CORS with preflight) and ``--api-key`` (one key, no tenant configuration), as vLLM has
them."""

from __future__ import annotations

import httpx
import pytest
from starlette.testclient import TestClient

from rtxcore.contracts.authenticator import Credentials
from rtxcore.engine.config import EngineConfig
from rtxcore.errors import ConfigError
from rtxcore.server.http import build_app
from rtxcore.server.serving.authentication import Authentication
from rtxcore.server.serving.runtime import ServingRuntime
from rtxcore.server.serving.settings import ServeSettings
from rtxcore.server.serving.tenants import DEFAULT_TENANT, TenantRegistry
from tests.helpers.server import start_server

APP = "http://app.example"
PREFLIGHT = {"Origin": APP, "Access-Control-Request-Method": "POST",
             "Access-Control-Request-Headers": "authorization, content-type"}


def client(origins: tuple[str, ...] = (), keys: tuple[str, ...] = ()) -> TestClient:
    runtime = ServingRuntime(EngineConfig(model="dummy:tiny"), ServeSettings(allowed_origins=origins),
                             TenantRegistry.from_config(None, {}, api_keys=keys))
    return TestClient(build_app(runtime))


def test_preflight_and_responses_carry_cors_headers_for_allowed_origins():
    c = client((APP,))
    pre = c.options("/v1/completions", headers=PREFLIGHT)
    assert pre.status_code == 200 and pre.headers["access-control-allow-origin"] == APP
    assert "POST" in pre.headers["access-control-allow-methods"]
    resp = c.get("/health", headers={"Origin": APP})
    assert resp.headers["access-control-allow-origin"] == APP
    assert "x-rtx-request-id" in resp.headers["access-control-expose-headers"]
    # Another origin gets no CORS headers: its browser keeps the response from the page.
    other = c.get("/health", headers={"Origin": "http://evil.example"})
    assert "access-control-allow-origin" not in other.headers
    assert c.options("/v1/completions", headers={**PREFLIGHT, "Origin": "http://evil.example"}).status_code == 400


def test_without_allowed_origins_there_is_no_cors():
    c = client()
    assert c.options("/v1/completions", headers=PREFLIGHT).status_code == 405
    assert "access-control-allow-origin" not in c.get("/health", headers={"Origin": APP}).headers


def test_preflight_needs_no_key_and_errors_are_readable_cross_origin():
    c = client(("*",), keys=("sk-one",))
    assert c.options("/v1/models", headers=PREFLIGHT).status_code == 200
    refused = c.get("/v1/models", headers={"Origin": APP})
    assert refused.status_code == 401 and refused.headers["access-control-allow-origin"] == "*"
    # The key passes: past authentication, an engine that was never loaded answers 503.
    ok = c.get("/v1/models", headers={"Origin": APP, "Authorization": "Bearer sk-one"})
    assert ok.status_code == 503 and ok.headers["access-control-allow-origin"] == "*"


def test_api_keys_make_a_default_tenant():
    registry = TenantRegistry.from_config(None, {}, api_keys=["k1", "k2"])
    auth = Authentication.from_config(None, registry)
    assert auth.required and auth.authenticate(Credentials(authorization="Bearer k2")).name == DEFAULT_TENANT
    with pytest.raises(ConfigError, match="must not be empty"):
        TenantRegistry.from_config(None, {}, api_keys=[""])


def test_serve_with_api_key_and_allowed_origins():
    with start_server("--model", "dummy:tiny", "--no-grpc", "--api-key", "sk-flag",
                      "--allowed-origins", f"{APP},http://other.example") as server:
        assert httpx.get(server.base_url + "/v1/models").status_code == 401
        resp = httpx.get(server.base_url + "/v1/models", headers={"Authorization": "Bearer sk-flag", "Origin": APP})
        assert resp.status_code == 200 and resp.headers["access-control-allow-origin"] == APP
        assert "sk-flag" not in server.stdout + server.stderr
