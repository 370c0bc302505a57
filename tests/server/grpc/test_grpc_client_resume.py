"""How the gRPC clients go on after a cut stream, on scripted calls (no server): resume after the last message, resume
a request the server named before its first message, end normally after the finished one, and give up (raise) when
the journal cannot help, the caller or policy says so, or the wait for the server is over."""

from __future__ import annotations

import grpc
import pytest

from rtxcore.client import NO_RETRY, APIError, GrpcClient, RetryPolicy
from rtxcore.client.grpc import RTX_REQUEST_ID_METADATA, rtx_pb2


class ScriptedCut(grpc.RpcError):
    def __init__(self, code: grpc.StatusCode, details: str = "cut"):
        self._code, self._details = code, details

    def code(self):
        return self._code

    def details(self):
        return self._details

    def trailing_metadata(self):
        return ()


class ScriptedCall:
    """A server-streaming call that delivers ``responses``, then ends with ``error`` (or OK)."""

    def __init__(self, responses, error=None, metadata=()):
        self.responses, self.error, self.metadata = responses, error, metadata

    def __iter__(self):
        yield from self.responses
        if self.error is not None:
            raise self.error

    def initial_metadata(self):
        return self.metadata

    def cancel(self):
        pass


class ScriptedChannel:
    """What a GrpcClient's stub calls: each Generate or Resume takes the next scripted call, and is recorded."""

    def __init__(self, *calls: ScriptedCall):
        self.calls, self.made = list(calls), []

    def unary_stream(self, method, **_):
        def call(request, timeout=None, metadata=None):
            self.made.append((method.rsplit("/", 1)[1], request))
            return self.calls.pop(0)
        return call

    def unary_unary(self, method, **_):
        return self.unary_stream(method)


def _message(event_id: int, token: int, finished: bool = False, request_id: str = "rq-1"):
    return rtx_pb2.GenerateResponse(request_id=request_id if event_id else "", event_id=event_id,
                                    token_ids=[token], finished=finished)


FAST = RetryPolicy(backoff_s=0.0, max_backoff_s=0.0)
CUT = ScriptedCut(grpc.StatusCode.UNAVAILABLE)


def _run(channel: ScriptedChannel, policy: RetryPolicy = FAST, **kwargs) -> list[int]:
    client = GrpcClient(channel=channel, retry=policy)
    return [t for m in client.generate([1, 2], **kwargs) for t in m.token_ids]


def test_a_journaled_stream_goes_on_after_its_last_message():
    channel = ScriptedChannel(ScriptedCall([_message(1, 10), _message(2, 11)], CUT),
                              ScriptedCall([], CUT),  # the server is not back yet
                              ScriptedCall([_message(3, 12), _message(4, 13, finished=True)]))
    assert _run(channel) == [10, 11, 12, 13]
    assert [(name, getattr(req, "after_event_id", None)) for name, req in channel.made] == [
        ("Generate", None), ("Resume", 2), ("Resume", 2)]


def test_a_stream_cut_before_its_first_message_resumes_the_request_the_server_named():
    from rtxcore.server.grpc.servicer import RTX_REQUEST_ID_METADATA as RTX_REQUEST_ID_HEADER

    assert RTX_REQUEST_ID_METADATA == RTX_REQUEST_ID_HEADER
    named = ((RTX_REQUEST_ID_METADATA, "rq-1"),)
    channel = ScriptedChannel(ScriptedCall([], CUT, named), ScriptedCall([_message(1, 10, finished=True)]))
    assert _run(channel) == [10]
    assert [name for name, _ in channel.made] == ["Generate", "Resume"]  # not sent twice
    assert channel.made[1][1].request_id == "rq-1" and channel.made[1][1].after_event_id == 0


def test_a_cut_after_the_last_message_loses_nothing():
    channel = ScriptedChannel(ScriptedCall([_message(1, 10), _message(2, 11, finished=True)], CUT))
    assert _run(channel) == [10, 11] and len(channel.made) == 1


def test_what_cannot_go_on_raises():
    # Without a journal (event id 0) a started stream cannot go on.
    with pytest.raises(APIError) as info:
        _run(ScriptedChannel(ScriptedCall([_message(0, 10)], CUT)))
    assert info.value.code == "UNAVAILABLE"
    # Nor when the caller said so, the policy allows no further call, or the wait for the server is over.
    for kwargs, policy in (({"resume": False}, FAST), ({}, NO_RETRY), ({}, RetryPolicy(max_resume_wait_s=0.0))):
        channel = ScriptedChannel(ScriptedCall([_message(1, 10)], CUT))
        with pytest.raises(APIError):
            _run(channel, policy, **kwargs)
        assert len(channel.made) == 1
    # Resume's own refusal is raised, caused by the cut.
    channel = ScriptedChannel(ScriptedCall([_message(1, 10)], CUT),
                              ScriptedCall([], ScriptedCut(grpc.StatusCode.NOT_FOUND, "no request 'rq-1'")))
    with pytest.raises(APIError) as info:
        _run(channel)
    assert info.value.code == "NOT_FOUND" and info.value.__cause__.code == "UNAVAILABLE"
