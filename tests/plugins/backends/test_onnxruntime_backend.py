"""The onnxruntime backend on the real default model: greedy tokens equal the torch backend's (alone, in a batch of
8, through chunked prefill and prefix-cache hits), the export is cached on disk, bad settings are refused, and
``rtx serve --backend onnxruntime`` streams and cancels like the torch backend.

The model is exported once per module into a temporary cache; every later engine and the server hit that cache.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from rtxcore.engine.config import EngineConfig
from rtxcore.engine.llm import LLM
from rtxcore.errors import ConfigError
from rtxcore.sampling_params import SamplingParams
from tests.helpers.engines import make_engine
from tests.helpers.prompts import PLAIN
from tests.helpers.server import start_server

pytest.importorskip("onnxruntime")
from rtx_plugins.backends.graph_runtime.cache import CACHE_DIR_ENV  # noqa: E402

pytestmark = pytest.mark.model

RTX = str(Path(sys.executable).parent / "rtx")
MAX_TOKENS = 8
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
PROMPTS = PLAIN + [
    "The three primary colours are",
    "Question: what is 7 times 8? Answer:",
    "import numpy as np\n\narr = np.",
    "Water boils at a temperature of",
    "My favourite book is",
]


@pytest.fixture(scope="module")
def graph_cache(tmp_path_factory):
    path = tmp_path_factory.mktemp("graph-cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(CACHE_DIR_ENV, str(path))
        yield path


@pytest.fixture(scope="module")
def ort_engine(graph_cache, registry, default_source):
    engine = LLM(EngineConfig(backend="onnxruntime", num_kv_blocks=512), registry=registry,
                       source=default_source)
    yield engine
    assert not engine.has_unfinished_requests()


def _tokens(engine, prompts, params=GREEDY, together=True):
    engine.core.kv_cache.reset_prefix_cache()
    if together:
        return [r.token_ids for r in engine.generate(prompts, params)]
    return [engine.generate([p], params)[0].token_ids for p in prompts]


def test_first_start_exports_into_the_cache(ort_engine, graph_cache):
    graph = ort_engine.core.backend.graph
    assert not graph.cache_hit and graph.export_s > 0
    assert graph.path.is_file() and graph.path.parent.parent == graph_cache
    assert (graph.path.parent / "key.json").is_file()


def test_greedy_tokens_equal_torch_alone(ort_engine, default_engine):
    prompts = PROMPTS[:5]
    assert _tokens(ort_engine, prompts, together=False) == _tokens(default_engine, prompts, together=False)


def test_greedy_tokens_equal_torch_in_a_batch_of_8(ort_engine, default_engine):
    ours = _tokens(ort_engine, PROMPTS)
    assert len(ours) == 8 and all(len(t) == MAX_TOKENS for t in ours)
    assert ours == _tokens(default_engine, PROMPTS)


def test_chunked_prefill_and_prefix_hits_equal_torch(graph_cache, registry, default_source, default_engine):
    # A second start: the export comes from the cache. A 32-token budget splits the prompt into chunks whose
    # later pieces read their past from the paged cache; the second run hits the prefix cache.
    engine = make_engine(None, registry=registry, source=default_source, backend="onnxruntime",
                         max_num_batched_tokens=32, num_kv_blocks=64)
    assert engine.core.backend.graph.cache_hit and engine.core.backend.graph.export_s == 0
    prompt = " ".join(PROMPTS)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    expected = _tokens(default_engine, [prompt], params)[0]
    first = engine.generate([prompt], params)[0]
    again = engine.generate([prompt], params)[0]
    assert len(first.prompt_token_ids) > 64
    assert first.token_ids == expected
    assert again.num_cached_tokens >= 48 and again.token_ids == expected


def test_incompatible_settings_are_refused(graph_cache, registry, default_source):
    with pytest.raises(ConfigError, match="cannot run dtype 'bfloat16'.*accepts: float32"):
        LLM(EngineConfig(backend="onnxruntime", dtype="bfloat16"), registry=registry, source=default_source)
    with pytest.raises(ConfigError, match="device 'tpu'"):
        LLM(EngineConfig(backend="onnxruntime", device="tpu"), registry=registry, source=default_source)


def test_cli_refuses_an_unsupported_dtype_in_one_line():
    r = subprocess.run([RTX, "generate", "hello", "--backend", "onnxruntime", "--dtype", "float16",
                        "--device", "cpu"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2
    assert r.stderr.strip().splitlines()[-1].endswith("cannot run dtype 'float16' here (it accepts: float32)")
    assert "Traceback" not in r.stderr


def test_serve_streams_and_cancels(graph_cache, ort_engine):
    expected = ort_engine.generate(["The capital of France is"], SamplingParams(max_tokens=8, temperature=0.0))[0]
    with start_server("--backend", "onnxruntime", "--no-grpc", "--num-kv-blocks", "256",
                      env={CACHE_DIR_ENV: str(graph_cache)}) as server:
        assert "export cache hit" in server.stderr
        body = {"prompt": "The capital of France is", "max_tokens": 8, "temperature": 0.0, "stream": True}
        with httpx.Client(base_url=server.base_url, timeout=60) as http:
            with http.stream("POST", "/v1/completions", json=body) as r:
                assert r.status_code == 200
                chunks = [line.removeprefix("data: ") for line in r.iter_lines() if line.startswith("data: ")]
            assert chunks[-1] == "[DONE]" and len(chunks) > 2
            text = "".join(httpx.Response(200, content=c).json()["choices"][0]["text"] for c in chunks[:-1])
            assert text == expected.text
            aborts = _metric(http, "rtx_request_aborts_total")
            long = {**body, "max_tokens": 2000, "ignore_eos": True}
            with http.stream("POST", "/v1/completions", json=long) as r:
                # The first event arrives (its "id:" line comes before its "data:" line).
                assert next(line for line in r.iter_lines() if line.startswith("data: "))
            # Leaving the block closed the connection mid-stream: the server aborts the request and frees its KV.
            assert _wait(lambda: _metric(http, "rtx_request_aborts_total") == aborts + 1)
            assert _wait(lambda: _metric(http, "rtx_kv_cache_usage_ratio") == 0)
            bad = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 0})
            assert bad.status_code == 400 and bad.json()["error"]["param"] == "max_tokens"


def _metric(http: httpx.Client, name: str) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    text = http.get("/metrics").text
    return sum(s.value for family in text_string_to_metric_families(text) for s in family.samples if s.name == name)


def _wait(condition, timeout: float = 30.0) -> bool:
    import time

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.1)
    return condition()


def test_blocks_come_back_from_the_host_tier(graph_cache, registry, default_source, default_engine):
    # A device cache of 12 blocks holds one long prompt at a time: the second prompt evicts the first, whose blocks
    # go to the host tier and come back (through read_kv_blocks / write_kv_blocks on the flat graph caches).
    engine = make_engine(None, registry=registry, source=default_source, backend="onnxruntime", num_kv_blocks=12,
                         kv_host_bytes=64 << 20)
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    first, second = " ".join(PROMPTS[:4] * 4), " ".join(PROMPTS[4:] * 4)
    expected = _tokens(default_engine, [first], params)[0]
    assert engine.generate([first], params)[0].token_ids == expected
    assert len(engine.inputs.encode(first)) > 96 and len(engine.inputs.encode(second)) > 96
    engine.generate([second], params)
    again = engine.generate([first], params)[0]
    assert engine.core.kv_cache.stats.num_reloaded_tokens >= 48 and again.num_cached_tokens >= 48
    assert again.token_ids == expected


def test_a_damaged_cached_export_is_exported_again(tmp_path, monkeypatch, registry, caplog):
    from rtxcore.models.resolve import resolve_model

    monkeypatch.setenv(CACHE_DIR_ENV, str(tmp_path))
    source = resolve_model("dummy:tiny")
    first = make_engine(None, registry=registry, source=source, backend="onnxruntime", num_kv_blocks=16)
    path = first.core.backend.graph.path
    expected = first.generate([[5, 6, 7]], GREEDY)[0].token_ids
    path.write_bytes(path.read_bytes()[:1000])  # cut short, as by a full disk
    again = make_engine(None, registry=registry, source=source, backend="onnxruntime", num_kv_blocks=16)
    assert "does not open" in caplog.text and not again.core.backend.graph.cache_hit
    assert again.generate([[5, 6, 7]], GREEDY)[0].token_ids == expected
