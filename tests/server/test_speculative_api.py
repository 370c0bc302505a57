"""Speculative decoding through the API: OpenAI's ``prediction``, ``draft_token_ids`` on ``/generate`` and gRPC, and
the ``speculative: false`` opt-out.

A prediction only changes how fast the output comes: each test checks the output is the one the same request gets
without it, and reads the engine's own counters (``core.speculator.stats``) to see the prediction was used, or not.
The app runs in process (``TestClient``, the official ``openai`` client over it) so those counters can be read;
gRPC runs on a real channel. Chat needs real text: those tests run the default model.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator

import grpc
import openai
import pytest
from starlette.testclient import TestClient

from rtxcore.engine.config import EngineConfig
from rtxcore.engine.input_processor import InputLimits, InputProcessor
from rtxcore.errors import InvalidRequestError
from rtxcore.sampling_params import SamplingParams
from rtxcore.server.grpc.codegen import ensure_generated
from rtxcore.server.http import build_app
from rtxcore.server.serving.runtime import ServingRuntime
from tests.helpers.grpc_server import ThreadedGrpcServer
from tests.helpers.server import assert_error

ensure_generated()
from rtxcore._generated import rtx_pb2, rtx_pb2_grpc  # noqa: E402

MODEL = "smollm2-135m"
CHAT = [{"role": "user", "content": "Write a Python function that adds two numbers."}]
PROMPT = [3, 14, 15, 92, 65, 35]
# dummy:tiny ends on no EOS with ignore_eos: every request runs its max_tokens.
GENERATE = {"prompt": PROMPT, "max_tokens": 24, "temperature": 0, "ignore_eos": True, "stream": False}


def assisted_counts(runtime: ServingRuntime) -> tuple[int, int]:
    """(proposed, accepted) tokens of the ``assisted`` proposer (caller-supplied tokens) so far, read on the engine
    thread between steps."""

    def read(core) -> tuple[int, int]:
        stats = core.speculator.stats["assisted"]
        return stats.num_proposed_tokens, stats.num_accepted_tokens

    assert runtime.async_engine is not None
    return asyncio.run(runtime.async_engine.run_on_engine(read))


def loaded(config: EngineConfig) -> Iterator[ServingRuntime]:
    runtime = ServingRuntime(config)
    runtime.load()
    assert runtime.load_error is None
    yield runtime
    runtime.stop()


@pytest.fixture(scope="module")
def tiny_runtime() -> Iterator[ServingRuntime]:
    yield from loaded(EngineConfig(model="dummy:tiny"))


@pytest.fixture(scope="module")
def tiny(tiny_runtime) -> Iterator[TestClient]:
    with TestClient(build_app(tiny_runtime)) as client:
        yield client


# -- the input processor ------------------------------------------------------------------------------------------


def test_make_request_checks_draft_token_ids_like_prompt_ids():
    inputs = InputProcessor(None, InputLimits(vocab_size=100, max_model_len=64, max_cache_tokens=1024, block_size=16),
                            "m")
    params = SamplingParams(max_tokens=8)
    req = inputs.make_request([1, 2], params, "a", draft_token_ids=(5, 6, 7))
    assert req.draft_token_ids == [5, 6, 7] and req.speculative
    assert inputs.make_request([1, 2], params, "b", draft_token_ids=[]).draft_token_ids is None
    # Opted out: nothing to propose from, so the engine does not count it as speculating.
    opted_out = inputs.make_request([1, 2], params, "c", draft_token_ids=[5], speculative=False)
    assert opted_out.draft_token_ids is None and not opted_out.speculative
    for bad in ([100], [-1], [5, "6"], [1.5], [0] * 65):
        with pytest.raises(InvalidRequestError) as info:
            inputs.make_request([1, 2], params, "d", draft_token_ids=bad)
        assert info.value.param == "draft_token_ids"
    with pytest.raises(InvalidRequestError) as info:  # refused whatever the flag
        inputs.make_request([1, 2], params, "e", draft_token_ids=[100], speculative=False)
    assert info.value.param == "draft_token_ids"
    with pytest.raises(InvalidRequestError) as info:
        inputs.encode_prediction("def add(a, b):")
    assert info.value.param == "prediction"


# -- OpenAI routes: request shapes (no tokenizer needed) ----------------------------------------------------------


BAD_PREDICTIONS = [
    "def add(a, b):",
    {"content": "x"},
    {"type": "text", "content": "x"},
    {"type": "content"},
    {"type": "content", "content": 5},
    {"type": "content", "content": ["x"]},
    {"type": "content", "content": [{"type": "image_url", "image_url": {"url": "http://x"}}]},
    {"type": "content", "content": [{"type": "text", "text": 3}]},
    [{"type": "content", "content": "x"}],
]


@pytest.mark.parametrize("prediction", BAD_PREDICTIONS)
@pytest.mark.parametrize("path, body", [("/v1/chat/completions", {"messages": CHAT}),
                                        ("/v1/completions", {"prompt": PROMPT})])
def test_a_malformed_prediction_is_a_400_naming_it(tiny, path, body, prediction):
    assert_error(tiny.post(path, json={**body, "prediction": prediction}), 400, "prediction")


@pytest.mark.parametrize("path, body", [("/v1/chat/completions", {"messages": CHAT}),
                                        ("/v1/completions", {"prompt": PROMPT})])
def test_speculative_must_be_a_bool(tiny, path, body):
    assert_error(tiny.post(path, json={**body, "speculative": "no"}), 400, "speculative")


def test_a_text_prediction_needs_a_tokenizer(tiny):
    error = assert_error(tiny.post("/v1/completions", json={"prompt": PROMPT, "prediction": {
        "type": "content", "content": "some text"}}), 400, "prediction")
    assert "tokenizer" in error["message"]
    # An empty prediction predicts nothing: nothing to encode.
    ok = tiny.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2, "prediction": {
        "type": "content", "content": []}})
    assert ok.status_code == 200, ok.text


# -- /generate ----------------------------------------------------------------------------------------------------


def test_generate_with_its_own_output_as_draft_gives_the_same_output(tiny_runtime, tiny):
    plain = tiny.post("/generate", json=GENERATE).json()
    tokens = _generated_tokens(tiny, GENERATE)
    before = assisted_counts(tiny_runtime)
    drafted = tiny.post("/generate", json={**GENERATE, "draft_token_ids": tokens}).json()
    assert drafted["text"] == plain["text"] and drafted["num_tokens"] == 24
    assert _generated_tokens(tiny, {**GENERATE, "draft_token_ids": tokens}) == tokens
    proposed, accepted = (a - b for a, b in zip(assisted_counts(tiny_runtime), before))
    assert accepted > 0 and accepted == proposed  # the draft is the output: every proposed token is accepted


def test_generate_with_a_wrong_draft_gives_the_same_output(tiny_runtime, tiny):
    tokens = _generated_tokens(tiny, GENERATE)
    wrong = [(t + 1) % 100 for t in tokens[:8]] + tokens[8:]  # an edit at the start, the rest as generated
    before = assisted_counts(tiny_runtime)
    assert _generated_tokens(tiny, {**GENERATE, "draft_token_ids": wrong}) == tokens
    proposed, accepted = (a - b for a, b in zip(assisted_counts(tiny_runtime), before))
    assert proposed > accepted


def test_generate_opted_out_proposes_nothing(tiny_runtime, tiny):
    tokens = _generated_tokens(tiny, GENERATE)
    before = assisted_counts(tiny_runtime)
    assert _generated_tokens(tiny, {**GENERATE, "draft_token_ids": tokens, "speculative": False}) == tokens
    assert assisted_counts(tiny_runtime) == before


@pytest.mark.parametrize("draft, param", [
    ([10**9], "draft_token_ids"),
    ([-1], "draft_token_ids"),
    ([5, "6"], "draft_token_ids"),
    ([True], "draft_token_ids"),
    ("5 6", "draft_token_ids"),
    ([0] * 100_000, "draft_token_ids"),  # more than the context could ever verify
])
def test_generate_refuses_bad_draft_token_ids(tiny, draft, param):
    assert_error(tiny.post("/generate", json={**GENERATE, "draft_token_ids": draft}), 400, param)
    # The streaming form refuses it before any event too.
    assert_error(tiny.post("/generate", json={**GENERATE, "draft_token_ids": draft, "stream": True}), 400, param)


def test_generate_refuses_a_non_bool_speculative(tiny):
    assert_error(tiny.post("/generate", json={**GENERATE, "speculative": None}), 400, "speculative")
    assert_error(tiny.post("/generate", json={**GENERATE, "speculative": 0}), 400, "speculative")


def _generated_tokens(client: TestClient, body: dict) -> list[int]:
    events = client.post("/generate", json={**body, "stream": True})
    assert events.status_code == 200, events.text
    return [t for line in events.text.splitlines() if line.startswith("data: ")
            for t in json.loads(line.removeprefix("data: "))["token_ids"]]


# -- gRPC ---------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def grpc_runtime() -> Iterator[ServingRuntime]:
    yield from loaded(EngineConfig(model="dummy:tiny"))


@pytest.fixture(scope="module")
def stub(grpc_runtime) -> Iterator[rtx_pb2_grpc.RtxStub]:
    server = ThreadedGrpcServer(grpc_runtime)
    try:
        with grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            yield rtx_pb2_grpc.RtxStub(channel)
    finally:
        server.stop(grace_s=1)


def _grpc_tokens(stub, **fields) -> list[int]:
    request = rtx_pb2.GenerateRequest(token_ids=rtx_pb2.TokenIds(ids=PROMPT), max_tokens=24, temperature=0.0,
                                      ignore_eos=True, **fields)
    return [t for response in stub.Generate(request) for t in response.token_ids]


def test_grpc_draft_token_ids_give_the_same_tokens(grpc_runtime, stub):
    tokens = _grpc_tokens(stub)
    assert len(tokens) == 24
    before = assisted_counts(grpc_runtime)
    assert _grpc_tokens(stub, draft_token_ids=tokens) == tokens
    proposed, accepted = (a - b for a, b in zip(assisted_counts(grpc_runtime), before))
    assert accepted > 0 and accepted == proposed
    before = assisted_counts(grpc_runtime)
    assert _grpc_tokens(stub, draft_token_ids=tokens, speculative=False) == tokens
    assert _grpc_tokens(stub, draft_token_ids=tokens[::-1], speculative=True) == tokens
    proposed, accepted = (a - b for a, b in zip(assisted_counts(grpc_runtime), before))
    assert proposed > accepted  # only the reversed draft was proposed (and mostly refused)


def test_grpc_refuses_draft_token_ids_outside_the_vocabulary(stub):
    with pytest.raises(grpc.RpcError) as info:
        _grpc_tokens(stub, draft_token_ids=[2**31 - 1])
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert dict(info.value.trailing_metadata())["rtx-param"] == "draft_token_ids"


# -- OpenAI routes on the real model ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def model_runtime() -> Iterator[ServingRuntime]:
    yield from loaded(EngineConfig())


@pytest.fixture(scope="module")
def http(model_runtime) -> Iterator[TestClient]:
    with TestClient(build_app(model_runtime)) as client:
        yield client


@pytest.fixture(scope="module")
def client(http) -> openai.OpenAI:
    # The official client, its requests sent to the app in process.
    return openai.OpenAI(base_url="http://testserver/v1", api_key="x", http_client=http, max_retries=0)


@pytest.fixture(scope="module")
def greedy_answer(client) -> str:
    answer = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=32, temperature=0)
    return answer.choices[0].message.content


def _chat(client: openai.OpenAI, **kwargs) -> str:
    answer = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=32, temperature=0, **kwargs)
    return answer.choices[0].message.content


@pytest.mark.model
def test_a_prediction_of_the_answer_is_accepted_and_changes_nothing(model_runtime, client, greedy_answer):
    before = assisted_counts(model_runtime)
    assert _chat(client, prediction={"type": "content", "content": greedy_answer}) == greedy_answer
    proposed, accepted = (a - b for a, b in zip(assisted_counts(model_runtime), before))
    assert accepted > 0 and accepted >= proposed // 2
    # Content parts are joined into one prediction.
    half = len(greedy_answer) // 2
    parts = [{"type": "text", "text": greedy_answer[:half]}, {"type": "text", "text": greedy_answer[half:]}]
    before = assisted_counts(model_runtime)
    assert _chat(client, prediction={"type": "content", "content": parts}) == greedy_answer
    assert assisted_counts(model_runtime)[1] > before[1]


@pytest.mark.model
def test_usage_counts_the_prediction_tokens_accepted_and_refused(model_runtime, client, greedy_answer):
    right = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=32, temperature=0,
                                           prediction={"type": "content", "content": greedy_answer})
    details = right.usage.completion_tokens_details
    assert details.accepted_prediction_tokens > 0 and details.rejected_prediction_tokens <= 1
    wrong = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=32, temperature=0,
                                           prediction={"type": "content", "content": "Nothing like the answer."})
    assert wrong.usage.completion_tokens_details.rejected_prediction_tokens > 0
    plain = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=32, temperature=0)
    assert plain.usage.completion_tokens_details is None


@pytest.mark.model
def test_a_wrong_prediction_changes_nothing(model_runtime, client, greedy_answer):
    wrong = "def subtract(x, y):\n    return x - y\n\nThis function subtracts one number from another."
    before = assisted_counts(model_runtime)
    assert _chat(client, prediction={"type": "content", "content": wrong}) == greedy_answer
    assert assisted_counts(model_runtime)[0] > before[0]  # it was tried


@pytest.mark.model
def test_speculative_false_proposes_nothing(model_runtime, client, greedy_answer):
    before = assisted_counts(model_runtime)
    answer = _chat(client, prediction={"type": "content", "content": greedy_answer},
                   extra_body={"speculative": False})
    assert answer == greedy_answer and assisted_counts(model_runtime) == before


@pytest.mark.model
def test_completions_take_a_prediction(model_runtime, client):
    prompt = "The capital of France is"
    plain = client.completions.create(model=MODEL, prompt=prompt, max_tokens=16, temperature=0).choices[0].text
    before = assisted_counts(model_runtime)
    predicted = client.completions.create(model=MODEL, prompt=prompt, max_tokens=16, temperature=0,
                                          extra_body={"prediction": {"type": "content", "content": plain}})
    assert predicted.choices[0].text == plain
    assert assisted_counts(model_runtime)[1] > before[1]


@pytest.mark.model
def test_a_prediction_longer_than_the_context_is_refused(model_runtime, http):
    long_text = " word" * (model_runtime.async_engine.core.max_model_len + 10)
    assert_error(http.post("/v1/chat/completions", json={"messages": CHAT, "prediction": {
        "type": "content", "content": long_text}}), 400, "prediction")
