"""Journaled gRPC requests (``rtx serve --state-dir``): every message carries an event id, a client that lost its call
resumes with ``Resume`` after the last event it got, also after the server was killed and restarted, and gets
exactly the rest. Greedy decoding on ``dummy:tiny`` makes every output comparable with an uninterrupted run."""

from __future__ import annotations

import asyncio
import json
import signal
import socket

import grpc
import httpx
import pytest

from rtxcore.client import APIError, AsyncGrpcClient, GrpcClient
from rtxcore.server.grpc.codegen import ensure_generated
from tests.helpers.server import metric, start_server

ensure_generated()
from rtxcore._generated import rtx_pb2, rtx_pb2_grpc  # noqa: E402

MODEL_ARGS = ("--model", "dummy:tiny")
PROMPT = [5, 17, 99, 3, 250, 41, 7, 12]


def generate_request(max_tokens: int) -> rtx_pb2.GenerateRequest:
    return rtx_pb2.GenerateRequest(token_ids=rtx_pb2.TokenIds(ids=PROMPT), max_tokens=max_tokens, temperature=0.0,
                                   ignore_eos=True)


def tokens(messages) -> list[int]:
    return [t for m in messages for t in m.token_ids]


def read_some(stub, max_tokens: int, num_messages: int, metadata=()) -> list[rtx_pb2.GenerateResponse]:
    """The first ``num_messages`` messages of a Generate call, then the call is cancelled (the client leaves)."""
    call = stub.Generate(generate_request(max_tokens), metadata=metadata)
    seen = []
    for message in call:
        seen.append(message)
        if len(seen) == num_messages:
            call.cancel()
            break
    return seen


def check_events(messages) -> None:
    assert [m.event_id for m in messages] == list(range(1, len(messages) + 1)), "event ids must run 1, 2, 3..."
    assert messages[-1].finished and all(not m.finished for m in messages[:-1])


def resume_and_rerun(server, first, max_tokens: int):
    """On a restarted server: the rest of the request ``first`` began (Resume after its last message), and an
    uninterrupted run of the same request to compare it with."""
    with grpc.insecure_channel(server.grpc_target) as channel:
        stub = rtx_pb2_grpc.RtxStub(channel)
        rest = list(stub.Resume(rtx_pb2.ResumeRequest(request_id=first[0].request_id,
                                                      after_event_id=first[-1].event_id)))
        return rest, list(stub.Generate(generate_request(max_tokens)))


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with start_server(*MODEL_ARGS, "--state-dir", str(tmp_path_factory.mktemp("state"))) as server:
        yield server


@pytest.fixture(scope="module")
def stub(server):
    with grpc.insecure_channel(server.grpc_target) as channel:
        yield rtx_pb2_grpc.RtxStub(channel)


def test_a_dropped_call_resumes_after_its_last_event(stub):
    whole = list(stub.Generate(generate_request(64)))
    check_events(whole)
    request_ids = {m.request_id for m in whole}
    assert len(request_ids) == 1 and next(iter(request_ids)).startswith("rq-")
    assert all(m.usage.prompt_tokens == len(PROMPT) for m in whole)

    first = read_some(stub, 64, 3)
    rest = list(stub.Resume(rtx_pb2.ResumeRequest(request_id=first[0].request_id,
                                                  after_event_id=first[-1].event_id)))
    check_events(first + rest)
    assert tokens(first + rest) == tokens(whole)
    assert rest[-1].usage.completion_tokens == 64

    replayed = list(stub.Resume(rtx_pb2.ResumeRequest(request_id=first[0].request_id)))
    assert [m.event_id for m in replayed] == [m.event_id for m in first + rest]
    assert tokens(replayed) == tokens(whole)


def test_the_clients_resume_a_request_they_left(server):
    """``GrpcClient.resume`` and ``AsyncGrpcClient.resume`` give the rest of a journaled request whose stream the
    client closed (which leaves it running, since it is journaled)."""
    params = {"max_tokens": 48, "temperature": 0.0, "ignore_eos": True}
    with GrpcClient(server.grpc_target) as client:
        whole = list(client.generate(PROMPT, **params))
        stream = client.generate(PROMPT, **params)
        first = [next(stream) for _ in range(3)]
        stream.close()
        rest = list(client.resume(first[0].request_id, after_event_id=first[-1].event_id))
    check_events(first + rest)
    assert tokens(first + rest) == tokens(whole)

    async def replay_with_the_async_client():
        async with AsyncGrpcClient(server.grpc_target) as client:
            return [m async for m in client.resume(first[0].request_id)]

    replayed = asyncio.run(replay_with_the_async_client())
    assert [m.event_id for m in replayed] == [m.event_id for m in first + rest]
    assert tokens(replayed) == tokens(whole)


def test_cancel_ends_a_journaled_request_with_abort_for_every_follower(server):
    """With a journal, closing a call leaves its request running; Cancel stops it, each follower's stream ending
    with finish_reason "abort" (a chat's stop button). The HTTP route is tested in test_durable_http.py."""
    with GrpcClient(server.grpc_target) as client:
        stream = client.generate(PROMPT, max_tokens=2000, ignore_eos=True)
        first = next(stream)
        req_id = first.request_id
        follower = client.resume(req_id)
        next(follower)
        assert client.cancel(req_id) is True
        for got in (list(stream), list(follower)):
            assert got[-1].finished and got[-1].finish_reason == "abort"
            assert sum(len(m.token_ids) for m in got) < 2000
        assert client.cancel(req_id) is False  # finished already
        replayed = list(client.resume(req_id))  # the journal has its end
        assert replayed[-1].finish_reason == "abort"
        for bad, code in (("rq-nothing-like-it", "NOT_FOUND"), ("", "INVALID_ARGUMENT")):
            with pytest.raises(APIError) as info:
                client.cancel(bad)
            assert info.value.code == code and info.value.param == "request_id"
    assert metric(server, "rtx_num_requests_running") == 0


def test_resume_refuses_what_it_cannot_follow(server, stub):
    with pytest.raises(grpc.RpcError) as info:
        list(stub.Resume(rtx_pb2.ResumeRequest(request_id="rq-nothing-like-it")))
    assert info.value.code() == grpc.StatusCode.NOT_FOUND

    done = list(stub.Generate(generate_request(4)))
    with pytest.raises(grpc.RpcError) as info:
        list(stub.Resume(rtx_pb2.ResumeRequest(request_id=done[0].request_id, after_event_id=len(done) + 1)))
    assert info.value.code() == grpc.StatusCode.OUT_OF_RANGE

    over_http = httpx.post(server.base_url + "/generate", json={"prompt": PROMPT, "max_tokens": 4, "stream": False})
    assert over_http.status_code == 200
    with pytest.raises(grpc.RpcError) as info:
        list(stub.Resume(rtx_pb2.ResumeRequest(request_id=over_http.headers["x-rtx-request-id"])))
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "GET /v1/streams/" in info.value.details()

    over_http = httpx.get(f"{server.base_url}/v1/streams/{done[0].request_id}")
    assert over_http.status_code == 400 and "Resume" in over_http.json()["error"]["message"]
    assert over_http.json()["error"]["code"] == "invalid_value"

    # No id at all is the caller's mistake, not a request that is not there.
    with pytest.raises(grpc.RpcError) as info:
        list(stub.Resume(rtx_pb2.ResumeRequest(request_id="")))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert dict(info.value.trailing_metadata())["rtx-param"] == "request_id"


def test_a_stream_resumes_across_a_kill_and_restart(tmp_path):
    """SIGKILL mid-stream, restart on the same state dir: Resume gives the rest, computed by the restarted server,
    joining the first messages without a gap or a repeat, in the trace the request came with."""
    state = tmp_path / "state"
    max_tokens = 400
    trace_id, parent_id = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
    trace = (("traceparent", f"00-{trace_id}-{parent_id}-01"), ("tracestate", "vendor=opaque"))
    server = start_server(*MODEL_ARGS, "--state-dir", str(state))
    try:
        with grpc.insecure_channel(server.grpc_target) as channel:
            first = read_some(rtx_pb2_grpc.RtxStub(channel), max_tokens, 3, metadata=trace)
        server.stop(signal.SIGKILL)
        assert not first[-1].finished
        # The journal keeps the trace context: tracestate reaches only the spans, so it is checked here.
        assert '"tracestate":"vendor=opaque"' in "".join(p.read_text(errors="replace") for p in state.rglob("*")
                                                          if p.is_file()).replace(" ", "")
        server = start_server(*MODEL_ARGS, "--state-dir", str(state), "--log-level", "info")
        rest, whole = resume_and_rerun(server, first, max_tokens)
        check_events(first + rest)
        assert tokens(first + rest) == tokens(whole)
        assert len(tokens(first + rest)) == max_tokens
        # The restarted server generated the rest itself: the request was unfinished in its journal.
        assert metric(server, "rtx_journal_resumed_requests_total") == 1
    finally:
        server.stop(signal.SIGKILL)
    finished = [json.loads(line[line.index("{"):]) for line in server.output().splitlines()
                if '"request_finished"' in line]
    # Two requests finished there: the resumed one, in its trace, and the rerun, which came without one.
    assert len(finished) == 2
    assert [(r["trace_id"], r["parent_span_id"]) for r in finished if "trace_id" in r] == [(trace_id, parent_id)]


def test_a_stream_cut_by_a_shutdown_resumes_after_the_restart(tmp_path):
    """SIGTERM with no grace period mid-stream: the call ends with an error (never as if complete), the request
    stays unfinished in the journal, and the next start finishes it for Resume."""
    state = str(tmp_path / "state")
    max_tokens = 500
    server = start_server(*MODEL_ARGS, "--state-dir", state, "--shutdown-grace", "0")
    try:
        with grpc.insecure_channel(server.grpc_target) as channel:
            call = rtx_pb2_grpc.RtxStub(channel).Generate(generate_request(max_tokens))
            first = [next(call) for _ in range(3)]
            server.send_signal(signal.SIGTERM)
            with pytest.raises(grpc.RpcError) as info:
                first.extend(call)
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE
            assert "Resume" in info.value.details()
            assert ("retry-after", "1") in tuple(info.value.trailing_metadata())
        assert server.stop() == 0, server.output()
        assert not first[-1].finished
        server = start_server(*MODEL_ARGS, "--state-dir", state)
        rest, whole = resume_and_rerun(server, first, max_tokens)
        check_events(first + rest)
        assert tokens(first + rest) == tokens(whole)
    finally:
        server.stop(signal.SIGKILL)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_the_client_goes_on_by_itself_across_a_kill_and_restart(tmp_path):
    """A ``GrpcClient.generate`` stream cut by SIGKILL goes on with ``Resume`` once a server is back on the same port
    and state dir, with no help from the caller: one stream of gapless events equal to an uninterrupted run."""
    port = free_port()
    args = (*MODEL_ARGS, "--state-dir", str(tmp_path / "state"), "--grpc-port", str(port))
    # Long enough to be still running at the kill on any machine (400 tokens once finished first on a loaded one:
    # the restart then replayed the journal's finished request and resumed none).
    params = {"max_tokens": 2000, "temperature": 0.0, "ignore_eos": True}
    server = start_server(*args)
    try:
        with GrpcClient(f"127.0.0.1:{port}") as client:  # the default retry policy
            stream = client.generate(PROMPT, **params)
            first = [next(stream) for _ in range(3)]
            server.stop(signal.SIGKILL)
            server = start_server(*args)
            messages = first + list(stream)
            whole = list(client.generate(PROMPT, **params))
        check_events(messages)
        assert tokens(messages) == tokens(whole)
        assert len(tokens(messages)) == params["max_tokens"]
        assert metric(server, "rtx_stream_resumes_total") == 1
        assert metric(server, "rtx_journal_resumed_requests_total") == 1
    finally:
        server.stop(signal.SIGKILL)


def test_a_tenant_resumes_only_its_own_requests(tmp_path):
    """Another tenant's request is as unknown to Resume as one that never was (NOT_FOUND with the same words). The
    request's trace says it came over gRPC, from which tenant, under the id the client gave it."""
    keys = {"alice": "alice-key", "bob": "bob-key"}
    env = {"RTX_API_KEYS": ",".join(f"{t}={k}" for t, k in keys.items())}
    alice, bob = ((("authorization", f"Bearer {keys[t]}"),) for t in ("alice", "bob"))
    with start_server(*MODEL_ARGS, "--state-dir", str(tmp_path / "state"), "--log-level", "info", env=env) as server, \
            grpc.insecure_channel(server.grpc_target) as channel:
        stub = rtx_pb2_grpc.RtxStub(channel)
        request = generate_request(4)
        request.request_id = "alices-own-id"
        done = list(stub.Generate(request, metadata=alice))
        req_id = done[0].request_id
        assert tokens(stub.Resume(rtx_pb2.ResumeRequest(request_id=req_id), metadata=alice)) == tokens(done)
        refusals = {}
        for name, who in (("other", req_id), ("unknown", "rq-000000000000000000000000")):
            with pytest.raises(grpc.RpcError) as info:
                list(stub.Resume(rtx_pb2.ResumeRequest(request_id=who), metadata=bob))
            refusals[name] = info.value
        assert refusals["other"].code() == refusals["unknown"].code() == grpc.StatusCode.NOT_FOUND
        assert refusals["other"].details() == refusals["unknown"].details().replace("rq-000000000000000000000000",
                                                                                    req_id)
        with pytest.raises(grpc.RpcError) as info:
            list(stub.Resume(rtx_pb2.ResumeRequest(request_id=req_id)))
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
    finished = [json.loads(line[line.index("{"):]) for line in server.output().splitlines()
                if '"request_finished"' in line]
    # The id a client sets names the request in traces; the responses carry the journal's.
    assert [(r["request_id"], r["protocol"], r["tenant"]) for r in finished] == [("alices-own-id", "grpc", "alice")]
