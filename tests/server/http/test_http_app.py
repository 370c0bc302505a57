"""The HTTP app's pieces in-process, without a server: the OpenAPI spec against the routes, the tracing and
request-id headers, the handler of unexpected errors, and SSE framing.
"""

from __future__ import annotations

import asyncio
import logging

import pytest

from tests.helpers import REPO
from tests.helpers.server import assert_error


def test_openapi_spec_lists_every_route():

    import yaml

    from rtxcore.engine.config import EngineConfig
    from rtxcore.server.http import build_app
    from rtxcore.server.serving.runtime import ServingRuntime

    spec = yaml.safe_load((REPO / "spec" / "openapi.yaml").read_text())
    assert spec["openapi"].startswith("3.1")
    documented = {(path, method.upper()) for path, ops in spec["paths"].items() for method in ops}
    app = build_app(ServingRuntime(EngineConfig(model="dummy:tiny")))
    served = {(route.path.replace("{model:path}", "{model}"), method)
              for route in app.routes if getattr(route, "include_in_schema", True)
              for method in route.methods if method != "HEAD"}
    assert documented == served


def test_openapi_spec_lists_the_fields_generate_takes():
    import yaml

    from rtxcore.server.http.protocol import GENERATE_FIELDS

    schemas = yaml.safe_load((REPO / "spec" / "openapi.yaml").read_text())["components"]["schemas"]
    # /generate refuses any field it does not take: the spec must list exactly those.
    assert set(schemas["GenerateRequest"]["properties"]) == GENERATE_FIELDS
    # The OpenAI routes ignore unknown fields, so only the extensions they do read are checked.
    assert {"prediction", "speculative", "lane", "cache_salt"} <= set(schemas["SamplingOptions"]["properties"])


def test_traceparent_and_request_id_parsing():
    from rtxcore.server.http.middleware import (
        TraceContext,
        parse_traceparent,
        sanitize_request_id,
    )

    good = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
    assert parse_traceparent(good) == ("4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7", "01")
    assert parse_traceparent(good.upper()) is not None
    for bad in ("", "garbage", good + "-extra", "ff" + good[2:], good.replace("00f067aa0ba902b7", "0" * 16),
                good.replace("4bf92f3577b34da6a3ce929d0e0e4736", "0" * 32), good[:-1]):
        assert parse_traceparent(bad) is None, bad
    assert parse_traceparent("01" + good[2:] + "-future") is not None  # later versions may append fields
    ctx = TraceContext.from_headers(good)
    assert ctx.traceparent.startswith("00-4bf92f3577b34da6a3ce929d0e0e4736-") and ctx.span_id != "00f067aa0ba902b7"
    assert TraceContext.from_headers(None).parent_id is None
    assert sanitize_request_id("abc-1.2:3_x") == "abc-1.2:3_x"
    assert sanitize_request_id("a b\x00c<script>") == "abcscript"
    assert len(sanitize_request_id("x" * 500)) == 64
    assert len(sanitize_request_id("///")) == 24


def test_an_unexpected_error_is_a_json_500_and_the_app_keeps_serving(caplog):
    from starlette.testclient import TestClient

    from rtxcore.engine.config import EngineConfig
    from rtxcore.server.http import build_app
    from rtxcore.server.serving.runtime import ServingRuntime

    runtime = ServingRuntime(EngineConfig(model="dummy:tiny"))
    runtime.metrics.render = lambda: 1 / 0  # a bug in a route
    with TestClient(build_app(runtime), raise_server_exceptions=False) as c:
        resp = c.get("/metrics", headers={"x-request-id": "r1"})
        error = assert_error(resp, 500)
        assert resp.headers["x-request-id"] == "r1" and "ZeroDivisionError" not in error["message"]
        assert "unhandled error in GET /metrics (request_id=r1)" in caplog.text
        assert c.get("/health").status_code == 200
        assert_error(c.post("/v1/completions", json={"prompt": "hi"}), 503)  # not loaded: nobody called load()


def _asgi_call(app, method: str, path: str, messages: list[dict], headers: list[tuple[bytes, bytes]]) -> list[dict]:
    """One request straight through the ASGI app, its body as ``messages`` (a client leaving is http.disconnect)."""
    sent: list[dict] = []

    async def receive() -> dict:
        return messages.pop(0) if messages else {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        sent.append(message)

    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": method, "scheme": "http",
             "path": path, "raw_path": path.encode(), "query_string": b"", "root_path": "",
             "headers": [(b"content-type", b"application/json"), *headers], "client": ("127.0.0.1", 1),
             "server": ("127.0.0.1", 80)}
    asyncio.run(app(scope, receive, send))
    return sent


def test_a_client_gone_mid_body_and_a_forged_log_line(caplog):
    from rtxcore.engine.config import EngineConfig
    from rtxcore.server.http import build_app
    from rtxcore.server.serving.runtime import ServingRuntime

    runtime = ServingRuntime(EngineConfig(model="dummy:tiny"))
    runtime.load()
    try:
        app = build_app(runtime)
        caplog.set_level(logging.INFO, "rtx.http")
        # The client sends half its body and leaves: no traceback and no 500, a 499 in the access log.
        half = [{"type": "http.request", "body": b'{"prompt":', "more_body": True}, {"type": "http.disconnect"}]
        sent = _asgi_call(app, "POST", "/v1/completions", half, [(b"content-length", b"100")])
        assert sent[0]["status"] == 499
        assert "unhandled error" not in caplog.text and "Traceback" not in caplog.text
        assert "POST /v1/completions 499" in caplog.text
        # A percent-decoded newline in the path stays inside its own access line.
        _asgi_call(app, "GET", "/v1/models/x\n2026-12-07 ERROR rtx.http: FAKE", [], [])
        assert "GET /v1/models/x\\n2026-12-07 ERROR rtx.http: FAKE 404" in caplog.text
        assert not any(r.getMessage().startswith("2026-12-07") for r in caplog.records)
    finally:
        runtime.stop()


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")  # the engine thread's error
def test_a_failed_engine_fails_the_liveness_probe():
    from starlette.testclient import TestClient

    from rtxcore.engine.config import EngineConfig
    from rtxcore.server.http import build_app
    from rtxcore.server.serving.runtime import ServingRuntime

    runtime = ServingRuntime(EngineConfig(model="dummy:tiny"))
    runtime.load()
    try:
        engine = runtime.async_engine.core
        request = {"prompt": [5, 6], "max_tokens": 4, "stream": False}
        sample = engine.sampler.sample
        engine.sampler.sample = lambda *args: 1 / 0  # a sampler plugin that raises in the step
        with TestClient(build_app(runtime), raise_server_exceptions=False) as c:
            assert c.get("/health").status_code == 200
            # A plugin failing on a request fails that request (naming the plugin), not the engine.
            error = assert_error(c.post("/generate", json=request), 500)
            assert "sampler plugin 'default' failed" in error["message"], error
            assert c.get("/health").status_code == 200
            # A backend failing every step: its requests fail, then the second step in a row ends the engine.
            engine.sampler.sample = sample
            engine.backend.execute = lambda batch: 1 / 0
            assert_error(c.post("/generate", json=request), 500)
            assert_error(c.post("/generate", json=request), 500)
            health = c.get("/health")
            assert health.status_code == 503 and health.json()["state"] == "failed"
            assert "2 steps in a row" in health.json()["error"] and "ZeroDivisionError" in health.json()["error"]
            assert_error(c.get("/ready"), 503)
    finally:
        runtime.stop()


def test_sse_events_stay_one_line_for_every_line_splitter():
    import json

    from rtxcore.server.http.sse import sse_data

    text = "a\nb\rc\x0bd\x0ce\x1cf\x1dg\x1eh\x85i\u2028j\u2029k"
    event = sse_data({"text": text}).decode()
    assert event.endswith("\n\n") and len(event[:-2].splitlines()) == 1
    assert json.loads(event[len("data: "):-2]) == {"text": text}


def test_served_model_names_first_is_the_id_the_rest_are_accepted():
    from starlette.testclient import TestClient

    from rtxcore.cli.main import build_parser
    from rtxcore.engine.config import EngineConfig
    from rtxcore.server.http import build_app
    from rtxcore.server.serving.runtime import ServingRuntime
    from rtxcore.server.serving.settings import ServeSettings

    args = build_parser().parse_args(["serve", "--served-model-name", "mine", "alias-a"])
    assert args.served_model_name == ["mine", "alias-a"]
    runtime = ServingRuntime(EngineConfig(model="dummy:tiny"),
                             ServeSettings(served_model_name="mine", served_model_aliases=("alias-a",)))
    runtime.load()
    try:
        with TestClient(build_app(runtime)) as c:
            assert [m["id"] for m in c.get("/v1/models").json()["data"]] == ["mine"]
            body = {"prompt": [5, 6], "max_tokens": 2}
            assert c.post("/v1/completions", json={**body, "model": "alias-a"}).status_code == 200
            assert_error(c.post("/v1/completions", json={**body, "model": "other"}), 404)
    finally:
        runtime.stop()
