"""Start ``rtx serve`` in a subprocess for tests (:mod:`rtxcore.chaos.served`, which the chaos drills share), and
read what it answers."""

from __future__ import annotations

import json

import httpx

from rtxcore.chaos.served import RTX, ServerError, ServerProcess, http_status, metric, start_server, wait_for

__all__ = ["RTX", "ServerError", "ServerProcess", "assert_error", "http_status", "metric", "sse_events",
           "start_server", "wait_for"]


def sse_events(response: httpx.Response):
    """Parsed ``data:`` payloads of an SSE response, as they arrive."""
    for line in response.iter_lines():
        if line.startswith("data: "):
            data = line.removeprefix("data: ")
            yield data if data == "[DONE]" else json.loads(data)


def assert_error(response: httpx.Response, status: int, param: str | None = None) -> dict:
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/json")
    error = response.json()["error"]
    assert error["message"] and error["type"] and "code" in error
    if param is not None:
        assert error["param"] == param, error
    assert "Traceback" not in response.text
    return error
