"""The gRPC server over a real channel: streaming Generate, Embed, health, reflection, status codes, and aborts on
cancellation, deadlines and timeouts (the engine frees the request's KV blocks)."""

from __future__ import annotations

import asyncio
import re
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from rtxcore.engine.config import EngineConfig
from rtxcore.sampling_params import SamplingParams
from rtxcore.server.grpc.codegen import (
    GENERATED_DIR,
    PROTO_FILE,
    ensure_generated,
    generate,
    is_current,
)
from rtxcore.server.serving.runtime import ServeSettings, ServingRuntime
from tests.helpers.engines import make_engine
from tests.helpers.grpc_server import ThreadedGrpcServer

ensure_generated()
from rtxcore._generated import rtx_pb2, rtx_pb2_grpc  # noqa: E402

MAX_ACTIVE = 4
PROMPTS = [[10 + i, 20 + i, 30 + i, 40 + i] * (i + 1) for i in range(4)]
LONG_PROMPT = list(range(10, 90))


@pytest.fixture(scope="module")
def runtime():
    settings = ServeSettings(grpc_port=0, max_active_requests=MAX_ACTIVE)
    runtime = ServingRuntime(EngineConfig(model="dummy:tiny"), settings)
    runtime.load()
    assert runtime.load_error is None
    yield runtime
    runtime.stop()


@pytest.fixture(scope="module")
def server(runtime):
    handle = ThreadedGrpcServer(runtime)
    yield handle
    handle.stop(grace_s=1)


@pytest.fixture(scope="module")
def channel(server):
    with grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        yield channel


@pytest.fixture
def stub(channel):
    return rtx_pb2_grpc.RtxStub(channel)


def request(prompt, **fields) -> rtx_pb2.GenerateRequest:
    return rtx_pb2.GenerateRequest(token_ids=rtx_pb2.TokenIds(ids=prompt), **fields)


def engine_state(runtime) -> tuple[bool, int, int]:
    """(has unfinished requests, free KV blocks, admitted requests), read on the engine thread between steps."""
    async_engine = runtime.async_engine

    def inspect(engine):
        return engine.has_unfinished_requests(), engine.kv_cache.num_free_blocks, runtime.num_active

    return asyncio.run(async_engine.run_on_engine(inspect))


def wait_idle(runtime, timeout_s: float = 10.0) -> tuple[bool, int, int]:
    deadline = time.monotonic() + timeout_s
    while (state := engine_state(runtime))[0] or state[2]:
        if time.monotonic() > deadline:
            break
        time.sleep(0.02)
    return state


def metric(runtime, name: str, **labels: str) -> float:
    """Sum of the samples of ``name`` whose labels include ``labels``."""
    total = 0.0
    for line in runtime.metrics.render()[0].decode().splitlines():
        match = re.match(rf"^{name}(?:{{(.*)}})? (\S+)$", line)
        if match and all(f'{k}="{v}"' in (match.group(1) or "") for k, v in labels.items()):
            total += float(match.group(2))
    return total


# -- generation ---------------------------------------------------------------------------------------------------

def test_generate_streams_the_same_tokens_as_offline(runtime, stub, registry):
    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    seeded = SamplingParams(max_tokens=12, temperature=0.8, top_k=40, top_p=0.9, seed=1234, ignore_eos=True)
    offline = make_engine(registry=registry)
    expected = [r.token_ids for r in offline.generate(PROMPTS, greedy)]
    expected_seeded = offline.generate([PROMPTS[0]], seeded)[0].token_ids

    for prompt, tokens in zip(PROMPTS, expected):
        responses = list(stub.Generate(request(prompt, max_tokens=12, temperature=0.0, ignore_eos=True)))
        assert [t for r in responses for t in r.token_ids] == tokens
        assert len(responses) > 1  # streamed, not one final message
        assert [r.finished for r in responses] == [False] * (len(responses) - 1) + [True]
        last = responses[-1]
        assert last.finish_reason == "length"
        assert (last.usage.prompt_tokens, last.usage.completion_tokens) == (len(prompt), 12)

    responses = stub.Generate(request(PROMPTS[0], max_tokens=12, temperature=0.8, top_k=40, top_p=0.9, seed=1234,
                                      ignore_eos=True))
    assert [t for r in responses for t in r.token_ids] == expected_seeded


def test_concurrent_streams_are_batched_and_match_offline(runtime, server, registry):
    greedy = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    expected = [r.token_ids for r in make_engine(registry=registry).generate(PROMPTS, greedy)]

    async def one(stub, prompt):
        tokens = []
        async for response in stub.Generate(request(prompt, max_tokens=10, temperature=0.0, ignore_eos=True)):
            tokens.extend(response.token_ids)
        return tokens

    async def main():
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            stub = rtx_pb2_grpc.RtxStub(channel)
            return await asyncio.gather(*(one(stub, p) for p in PROMPTS))

    assert asyncio.run(main()) == expected


def test_request_id_and_logprobs_come_back(stub):
    responses = list(stub.Generate(request([5, 6, 7], max_tokens=3, temperature=0.0, logprobs=2,
                                           request_id="my-request-1")))
    assert {r.request_id for r in responses} == {"my-request-1"}
    logprobs = [lp for r in responses for lp in r.logprobs]
    assert [lp.token_id for lp in logprobs] == [t for r in responses for t in r.token_ids]
    assert all(len(lp.top) == 2 and lp.top[0].token_id == lp.token_id for lp in logprobs)  # greedy: best is chosen


def test_two_calls_may_use_the_same_request_id(stub):
    """A client's id names its request in traces and responses only: ids are not shared between clients (or
    tenants), so neither can learn of or block the other's."""
    first = stub.Generate(request([5, 6, 7], max_tokens=1000, ignore_eos=True, request_id="same"))
    started = next(first)  # running in the engine while the second call comes
    second = list(stub.Generate(request([8, 9], max_tokens=5, ignore_eos=True, request_id="same")))
    rest = [started, *first]
    assert sum(len(r.token_ids) for r in rest) == 1000 and sum(len(r.token_ids) for r in second) == 5
    assert {r.request_id for r in rest + second} == {"same"}


def test_embed_takes_text_or_token_inputs_not_both(stub):
    with pytest.raises(grpc.RpcError) as info:
        stub.Embed(rtx_pb2.EmbedRequest(inputs=["hi"], token_inputs=[rtx_pb2.TokenIds(ids=[5, 6])]))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert dict(info.value.trailing_metadata())["rtx-param"] == "token_inputs"


def test_embed_matches_the_engine(runtime, stub, registry):
    inputs = [[5, 6, 7], [9, 9, 9, 9, 9]]
    response = stub.Embed(rtx_pb2.EmbedRequest(token_inputs=[rtx_pb2.TokenIds(ids=x) for x in inputs]))
    expected = make_engine(registry=registry).embed(inputs)
    assert len(response.embeddings) == 2
    for got, want in zip(response.embeddings, expected):
        assert got.values == pytest.approx(want, abs=1e-6)
    assert response.prompt_tokens == 8
    assert response.model == runtime.model_name


def test_token_lists_hold_the_sampled_tokens(stub):
    allowed = [r.token_ids for r in stub.Generate(request([5, 6, 7], max_tokens=12, temperature=1.0, seed=2,
                                                          allowed_token_ids=rtx_pb2.TokenIds(ids=[41, 42])))]
    assert set(t for ids in allowed for t in ids) <= {41, 42}
    biased = [t for r in stub.Generate(request([5, 6, 7], max_tokens=8, temperature=1.0, seed=2,
                                               logit_bias={77: 100.0})) for t in r.token_ids]
    assert biased == [77] * 8
    banned = [t for r in stub.Generate(request([5, 6, 7], max_tokens=8, temperature=0.0, banned_token_ids=biased[:1],
                                               logit_bias={77: 100.0, 78: 50.0})) for t in r.token_ids]
    assert banned == [78] * 8
    # min_tokens holds the stop token back for the first three tokens, then it is the greedy choice.
    held = [t for r in stub.Generate(request([5, 6, 7], max_tokens=8, temperature=0.0, stop_token_ids=[77],
                                             logit_bias={77: 100.0}, min_tokens=3)) for t in r.token_ids]
    assert len(held) == 4 and held[3] == 77 and 77 not in held[:3]


# -- errors -------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("fields, param", [
    ({"top_p": 1.5}, "top_p"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": 2, "min_tokens": 3}, "min_tokens"),
    ({"temperature": -1.0}, "temperature"),
    ({"max_tokens": 5000}, "max_tokens"),  # longer than the model's context
    ({"json_schema": "[" * 100_000 + "]" * 100_000}, "json_schema"),  # past Python's parser: RecursionError
    ({"request_id": "x" * 65}, "request_id"),  # it goes into logs and Resume: HTTP's x-request-id bounds
    ({"request_id": "a\nb"}, "request_id"),
    # The field is logits_processors (as over HTTP), not the processor's name.
    ({"logits_processors": {"logit_bias": "not json"}}, "logits_processors"),
])
def test_invalid_parameters_are_invalid_argument_naming_the_field(stub, runtime, fields, param):
    with pytest.raises(grpc.RpcError) as info:
        list(stub.Generate(request([5, 6, 7], **fields)))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert param in info.value.details()
    assert dict(info.value.trailing_metadata())["rtx-param"] == param
    assert not wait_idle(runtime)[0]


@pytest.mark.parametrize("req, message", [
    (rtx_pb2.GenerateRequest(max_tokens=3), "prompt is required"),
    (request([5, 600]), "prompt token ids"),  # outside the tiny vocabulary
    (rtx_pb2.GenerateRequest(text="hello"), "no tokenizer"),
])
def test_bad_prompts_are_invalid_argument(stub, req, message):
    with pytest.raises(grpc.RpcError) as info:
        list(stub.Generate(req))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert message in info.value.details()


@pytest.mark.parametrize("req, message", [
    (rtx_pb2.EmbedRequest(), "inputs must hold at least one input"),
    # as over HTTP: one call is one job on the engine thread, which holds up every stream while it runs
    (rtx_pb2.EmbedRequest(token_inputs=[rtx_pb2.TokenIds(ids=[5])] * 257), "at most 256 are accepted"),
    (rtx_pb2.EmbedRequest(inputs=["hello"]), "no tokenizer"),
    (rtx_pb2.EmbedRequest(token_inputs=[rtx_pb2.TokenIds(ids=[])]), "inputs is empty"),
])
def test_bad_embed_is_invalid_argument(stub, req, message):
    with pytest.raises(grpc.RpcError) as info:
        stub.Embed(req)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert message in info.value.details()


def test_unknown_model_is_not_found(stub, runtime):
    with pytest.raises(grpc.RpcError) as info:
        list(stub.Generate(request([5, 6, 7], model="no-such-model")))
    assert info.value.code() == grpc.StatusCode.NOT_FOUND
    assert "no-such-model" in info.value.details()
    # The served name is accepted.
    assert list(stub.Generate(request([5, 6, 7], model=runtime.model_name, max_tokens=2)))[-1].finished


def test_full_server_is_resource_exhausted_with_retry_after(stub, runtime):
    before = metric(runtime, "rtx_requests_rejected_total", reason="overloaded")
    calls = [stub.Generate(request(LONG_PROMPT, max_tokens=1900, ignore_eos=True)) for _ in range(MAX_ACTIVE)]
    try:
        for call in calls:
            next(call)  # each is admitted and streaming
        with pytest.raises(grpc.RpcError) as info:
            list(stub.Generate(request([5, 6, 7], max_tokens=2)))
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert dict(info.value.trailing_metadata())["retry-after"] == "1"
        assert metric(runtime, "rtx_requests_rejected_total", reason="overloaded") == before + 1
    finally:
        for call in calls:
            call.cancel()
    assert not wait_idle(runtime)[0]
    assert list(stub.Generate(request([5, 6, 7], max_tokens=2)))[-1].finished  # room again


# -- aborts -------------------------------------------------------------------------------------------------------

def test_cancelling_mid_stream_aborts_the_request_and_frees_its_blocks(stub, runtime):
    _, idle_free_blocks, _ = wait_idle(runtime)
    aborts = metric(runtime, "rtx_request_aborts_total")
    call = stub.Generate(request(LONG_PROMPT, max_tokens=1900, ignore_eos=True))
    for _ in range(3):
        assert not next(call).finished
    unfinished, free_blocks, active = engine_state(runtime)
    assert unfinished and active == 1 and free_blocks < idle_free_blocks  # it holds KV blocks now

    call.cancel()

    assert wait_idle(runtime) == (False, idle_free_blocks, 0)
    assert metric(runtime, "rtx_request_aborts_total") == aborts + 1
    assert metric(runtime, "rtx_requests_finished_total", finish_reason="abort") >= 1


def test_client_deadline_aborts_the_request(stub, runtime):
    _, idle_free_blocks, _ = wait_idle(runtime)
    aborts = metric(runtime, "rtx_request_aborts_total")
    with pytest.raises(grpc.RpcError) as info:
        list(stub.Generate(request(LONG_PROMPT, max_tokens=1900, ignore_eos=True), timeout=0.5))
    assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert wait_idle(runtime) == (False, idle_free_blocks, 0)
    assert metric(runtime, "rtx_request_aborts_total") == aborts + 1


def test_server_timeout_is_deadline_exceeded(stub, runtime, monkeypatch):
    _, idle_free_blocks, _ = wait_idle(runtime)
    timeouts = metric(runtime, "rtx_request_timeouts_total")
    monkeypatch.setattr(runtime.settings, "request_timeout_s", 0.3)
    with pytest.raises(grpc.RpcError) as info:
        list(stub.Generate(request(LONG_PROMPT, max_tokens=1900, ignore_eos=True)))
    assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert "timed out after 0.3s" in info.value.details()
    assert wait_idle(runtime) == (False, idle_free_blocks, 0)
    assert metric(runtime, "rtx_request_timeouts_total") == timeouts + 1


# -- health, reflection, life cycle -------------------------------------------------------------------------------

def test_resume_without_a_journal_is_failed_precondition(stub):
    with pytest.raises(grpc.RpcError) as info:
        list(stub.Resume(rtx_pb2.ResumeRequest(request_id="rq-anything")))
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "--state-dir" in info.value.details()


def test_without_a_journal_messages_carry_no_event_id(stub):
    assert [m.event_id for m in stub.Generate(request(PROMPTS[0], max_tokens=3, ignore_eos=True))] == [0, 0, 0]


def test_health_is_serving(channel):
    health = health_pb2_grpc.HealthStub(channel)
    for service in ("", "rtx.v1.Rtx"):
        assert health.Check(health_pb2.HealthCheckRequest(service=service)).status == \
            health_pb2.HealthCheckResponse.SERVING


def test_reflection_lists_and_describes_the_service(channel):
    reflection = reflection_pb2_grpc.ServerReflectionStub(channel)
    requests = [reflection_pb2.ServerReflectionRequest(list_services=""),
                reflection_pb2.ServerReflectionRequest(file_containing_symbol="rtx.v1.Rtx")]
    listed, described = list(reflection.ServerReflectionInfo(iter(requests)))
    names = {s.name for s in listed.list_services_response.service}
    assert {"rtx.v1.Rtx", "grpc.health.v1.Health"} <= names
    from google.protobuf import descriptor_pb2

    files = [descriptor_pb2.FileDescriptorProto.FromString(b)
             for b in described.file_descriptor_response.file_descriptor_proto]
    methods = {m.name for f in files for s in f.service if s.name == "Rtx" for m in s.method}
    assert methods == {"Generate", "Resume", "Cancel", "Embed"}


def test_health_follows_loading_and_draining():
    runtime = ServingRuntime(EngineConfig(model="dummy:tiny"), ServeSettings(grpc_port=0))
    server = ThreadedGrpcServer(runtime)
    try:
        with grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            health = health_pb2_grpc.HealthStub(channel)
            stub = rtx_pb2_grpc.RtxStub(channel)

            def status():
                return health.Check(health_pb2.HealthCheckRequest(service="rtx.v1.Rtx")).status

            def wait_status(want):
                deadline = time.monotonic() + 5
                while status() != want and time.monotonic() < deadline:
                    time.sleep(0.05)
                return status()

            assert status() == health_pb2.HealthCheckResponse.NOT_SERVING
            with pytest.raises(grpc.RpcError) as info:
                list(stub.Generate(request([5, 6, 7])))
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE
            assert dict(info.value.trailing_metadata())["retry-after"] == "1"

            runtime.load()
            assert wait_status(health_pb2.HealthCheckResponse.SERVING) == health_pb2.HealthCheckResponse.SERVING
            assert list(stub.Generate(request([5, 6, 7], max_tokens=2)))[-1].finished

            runtime.draining = True
            assert wait_status(health_pb2.HealthCheckResponse.NOT_SERVING) == \
                health_pb2.HealthCheckResponse.NOT_SERVING
            with pytest.raises(grpc.RpcError) as info:
                list(stub.Generate(request([5, 6, 7])))
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        server.stop(grace_s=0)
        runtime.stop()


def test_port_in_use_fails_at_start(server, runtime):
    with pytest.raises(Exception, match="bind|address|port"):
        ThreadedGrpcServer(runtime, port=server.port)


# -- code generation ----------------------------------------------------------------------------------------------

def test_generated_code_is_current_and_regenerates(tmp_path):
    assert is_current()
    proto = tmp_path / "rtx.proto"
    proto.write_text(PROTO_FILE.read_text())
    out = tmp_path / "_generated"
    assert not is_current(proto, out)
    generate(proto, out)
    assert is_current(proto, out)
    assert "from . import rtx_pb2" in (out / "rtx_pb2_grpc.py").read_text()
    assert (out / "rtx_pb2.py").read_bytes() == (GENERATED_DIR / "rtx_pb2.py").read_bytes()
    proto.write_text(proto.read_text() + "\nmessage Extra {}\n")  # the spec changed (a git pull, say)
    assert not is_current(proto, out)
