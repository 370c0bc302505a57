"""Fixtures of the HTTP tests: ``rtx serve`` on the default model without gRPC, one per test module that uses it
(a module that needs other options defines its own ``server``), and the official ``openai`` client and an httpx
client on it."""

from __future__ import annotations

import httpx
import openai
import pytest

from tests.helpers.server import start_server


@pytest.fixture(scope="module")
def server():
    srv = start_server("--no-grpc")
    yield srv
    assert srv.stop() == 0, srv.output()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="x", max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.base_url, timeout=120) as c:
        yield c
