"""The ``rtx.v1.Rtx`` service: ``Generate`` streams a request's outputs, ``Resume`` follows a journaled one again,
``Embed`` embeds. Each call is parsed here, run by the serving core (``rtxcore.server.serving``) exactly as an HTTP
request is, and its errors become gRPC statuses (``statuses.py``).

``Generate`` has one path: the request is admitted, begun (journaled first when the server has a state dir) and
followed message by message. With a journal every message carries an ``event_id`` and the journal's
``request_id``, and a client that lost its call, even to a server restart, calls ``Resume`` with both; leaving the
call then does not abort the request. Without one, leaving the call (client gone, deadline passed) aborts it and
frees its KV blocks.
"""

from __future__ import annotations

import json
import re
import secrets
import time

import grpc

from rtxcore.errors import ErrorCode, InvalidRequestError, RequestError
from rtxcore.metrics.timeline import TraceHeaders
from rtxcore.server.grpc.codegen import ensure_generated
from rtxcore.server.grpc.messages import (
    prompt_from,
    response_from_event,
    sampling_params_from,
    speculation_from,
)
from rtxcore.server.grpc.statuses import abort_with, statuses_for
from rtxcore.server.serving.authentication import certificate_subject
from rtxcore.server.serving.embedding import embed
from rtxcore.server.serving.formats import ResponseSpec
from rtxcore.server.serving.generation import Generation, tokenize
from rtxcore.server.serving.lifecycle import Started, begin, cancel, find
from rtxcore.server.serving.limits import MAX_BATCH, RETRY_AFTER_S
from rtxcore.server.serving.proxies import DEFAULT_TRUSTED, TrustedProxies
from rtxcore.server.serving.routing import route
from rtxcore.server.serving.runtime import ServingRuntime
from rtxcore.server.serving.served_request import ServedRequest
from rtxcore.server.serving.tenants import Tenant

ensure_generated()
from rtxcore._generated import rtx_pb2, rtx_pb2_grpc  # noqa: E402

# Metadata keys naming the request's lane and prefix-cache salt (as the HTTP header and body field do).
LANE_METADATA = "x-rtx-lane"
CACHE_SALT_METADATA = "x-rtx-cache-salt"
# Initial metadata naming the request: what Resume takes.
RTX_REQUEST_ID_METADATA = "x-rtx-request-id"
# A client's request_id: the characters and length HTTP keeps of an x-request-id header.
_CLIENT_ID = re.compile(r"[A-Za-z0-9._:-]{1,64}")

SERVICE_NAME = rtx_pb2.DESCRIPTOR.services_by_name["Rtx"].full_name


class RtxServicer(rtx_pb2_grpc.RtxServicer):
    def __init__(self, runtime: ServingRuntime):
        self.runtime = runtime
        # Who the caller is behind a proxy, as uvicorn works it out for HTTP (rtxcore.server.serving.proxies).
        self._proxies = TrustedProxies(runtime.settings.forwarded_allow_ips or DEFAULT_TRUSTED)

    async def Generate(self, request: rtx_pb2.GenerateRequest, context: grpc.aio.ServicerContext) -> None:
        received_at = time.monotonic()
        runtime = self.runtime
        async with statuses_for(context):
            engine = runtime.engine()
            metadata = dict(context.invocation_metadata() or ())
            tenant = self._authenticate(metadata, context)  # first, as over HTTP: nothing is told to a stranger
            runtime.check_model(request.model or None)
            params = sampling_params_from(request)
            where = route(runtime, tenant, metadata.get(LANE_METADATA), metadata.get(CACHE_SALT_METADATA),
                          lane_param=LANE_METADATA)
            prompts = await tokenize(engine.inputs, [prompt_from(request)])
            trace = TraceHeaders.received(metadata.get("traceparent"), metadata.get("tracestate"))
            # The engine's ids are the server's own: a client's id, shared by every tenant's clients, would let one
            # tenant find out or block another's ids.
            client_id = request.request_id
            if client_id and not _CLIENT_ID.fullmatch(client_id):  # it goes into logs, metrics' exemplars, Resume
                raise InvalidRequestError("request_id must be at most 64 characters of A-Z, a-z, 0-9 and . _ : -",
                                          param="request_id")
            gen = await Generation.start(runtime, client_id or f"grpc-{secrets.token_hex(12)}", prompts, params,
                                         trace, where, protocol="grpc", speculation=speculation_from(request),
                                         received_at=received_at)
            spec = ResponseSpec("grpc", True, {"id": gen.req_id, "model": runtime.model_name},
                                logprobs=params.logprobs is not None)
            entry = await begin(runtime, Started(gen, spec, prompts, params))
        journaled = runtime.durable is not None
        if journaled:
            await context.send_initial_metadata(((RTX_REQUEST_ID_METADATA, entry.req_id),))
        # Without a journal the messages name the client's request (or the server's id for it) and carry no
        # event id: there is nothing to resume.
        await self._follow(context, entry, 0, None if journaled else (client_id or gen.req_id))

    async def Resume(self, request: rtx_pb2.ResumeRequest, context: grpc.aio.ServicerContext) -> None:
        runtime = self.runtime
        req_id, after = request.request_id, request.after_event_id
        async with statuses_for(context):
            entry = self._find_journaled(req_id, context, "resume it with GET /v1/streams/{}")
            if after > entry.last_seq:
                raise RequestError(ErrorCode.OUT_OF_RANGE, f"after_event_id {after}: request {req_id!r} has sent "
                                   f"{entry.last_seq} messages so far", param="after_event_id")
        assert runtime.durable is not None  # find() refuses a server without a journal
        runtime.durable.stats.num_stream_resumes += 1
        await context.send_initial_metadata(((RTX_REQUEST_ID_METADATA, entry.req_id),))
        await self._follow(context, entry, after, None)

    async def Cancel(self, request: rtx_pb2.CancelRequest, context: grpc.aio.ServicerContext
                     ) -> rtx_pb2.CancelResponse:
        async with statuses_for(context):
            entry = self._find_journaled(request.request_id, context, "cancel it with DELETE /v1/streams/{}")
            return rtx_pb2.CancelResponse(cancelled=await cancel(self.runtime, entry))
        raise AssertionError("statuses_for aborts the call on an error")  # pragma: no cover

    def _find_journaled(self, req_id: str, context: grpc.aio.ServicerContext, over_http: str) -> ServedRequest:
        """The journaled gRPC request ``req_id`` of the caller's tenant.

        :param over_http: what to do instead for a request made over HTTP (``{}``: its id).
        :raises RequestError: no id, no journal, no such request of this tenant, or one made over HTTP.
        """
        if not req_id:
            raise InvalidRequestError("request_id is required: the id a journaled call's first message (or its "
                                      "x-rtx-request-id metadata) gave", param="request_id")
        self.runtime.engine()
        tenant = self._authenticate(dict(context.invocation_metadata() or ()), context)
        entry = find(self.runtime, req_id, tenant.name if tenant is not None else None)
        if entry.kind != "grpc":
            raise RequestError(ErrorCode.FAILED_PRECONDITION, f"request {req_id!r} was made over HTTP: "
                               f"{over_http.format(req_id)}", param="request_id")
        return entry

    async def _follow(self, context: grpc.aio.ServicerContext, entry: ServedRequest, after: int,
                      request_id: str | None) -> None:
        """Send ``entry``'s messages after event ``after`` as they are produced, until it finishes.

        :param request_id: the id the messages carry, with event id 0, for a request that cannot be resumed; None
            for the journal's id and event ids.
        """
        finished = False
        try:
            async for seq, payload in entry.follow(after):
                event = json.loads(payload)
                if "error" in event:
                    finished = True
                    await abort_with(context, RequestError.from_json(event["error"]))
                await context.write(response_from_event(request_id or entry.req_id,
                                                        0 if request_id is not None else seq, event))
            finished = entry.finished
        finally:
            # A call that leaves early stops only its following when the request is journaled (it runs on, to be
            # resumed); otherwise nobody will read the request any more.
            if not finished and self.runtime.durable is None and entry.producer is not None:
                entry.producer.cancel()
        if not entry.finished:  # abandoned: the server is shutting down
            await abort_with(context, RequestError(
                ErrorCode.UNAVAILABLE, f"the server stopped before request {entry.req_id} finished; it is in the "
                "journal: call Resume with after_event_id = the last event_id you got once the server is back",
                retry_after_s=RETRY_AFTER_S))

    async def Embed(self, request: rtx_pb2.EmbedRequest, context: grpc.aio.ServicerContext) -> rtx_pb2.EmbedResponse:
        runtime = self.runtime
        async with statuses_for(context):
            engine = runtime.engine()
            tenant = self._authenticate(dict(context.invocation_metadata() or ()), context)
            runtime.check_model(request.model or None)
            if request.inputs and request.token_inputs:
                # Concatenated, the answer's order would say nothing of which embedding is whose.
                raise InvalidRequestError("set inputs or token_inputs, not both", param="token_inputs")
            inputs = [*request.inputs, *(list(t.ids) for t in request.token_inputs)]
            if not inputs:
                raise InvalidRequestError("inputs must hold at least one input", param="inputs")
            if len(inputs) > MAX_BATCH:  # one call runs as one job on the engine thread, holding up every stream
                raise InvalidRequestError(f"inputs hold {len(inputs)} items; at most {MAX_BATCH} are accepted",
                                          param="inputs")
            token_lists = await tokenize(engine.inputs, inputs, "inputs")
            vectors = await embed(runtime, tenant, token_lists, "inputs")
        return rtx_pb2.EmbedResponse(embeddings=[rtx_pb2.Embedding(values=v) for v in vectors],
                                     model=runtime.model_name, prompt_tokens=sum(len(t) for t in token_lists))

    def _authenticate(self, metadata: dict, context: grpc.aio.ServicerContext) -> Tenant | None:
        """The caller's tenant, from its ``authorization`` (or ``x-api-key``) metadata and its verified client
        certificate (mTLS).

        :raises AuthError: no authenticator proves a known tenant (UNAUTHENTICATED).
        :raises TooManyFailures: the caller's address failed too often lately (RESOURCE_EXHAUSTED).
        """
        from rtxcore.contracts.authenticator import Credentials

        auth = self.runtime.auth
        if not auth.required:
            return None
        pem = (context.auth_context() or {}).get("x509_pem_cert")
        peer = self._proxies.client(_peer_address(context.peer()), metadata.get("x-forwarded-for"))
        credentials = Credentials(authorization=metadata.get("authorization"), api_key=metadata.get("x-api-key"),
                                  client_cert_subject=certificate_subject(pem[0]) if pem else None, peer=peer)
        try:
            return auth.authenticate(credentials)
        except RequestError as exc:
            self.runtime.metrics.record_rejection("unauthorized" if exc.code is ErrorCode.UNAUTHENTICATED
                                                  else "auth_rate_limited")
            raise


def _peer_address(peer: str | None) -> str | None:
    """The address of gRPC's ``ipv4:127.0.0.1:5000`` / ``ipv6:[::1]:5000`` peer string, without the port."""
    if not peer:
        return None
    kind, _, rest = peer.partition(":")
    if kind == "ipv6" and rest.startswith("["):
        return rest[1:rest.find("]")]
    if kind == "ipv4":
        return rest.rpartition(":")[0]
    return peer
