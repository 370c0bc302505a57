"""The ``rtx.v1.Rtx`` service: ``Generate`` streams a request's outputs from the shared engine, ``Resume`` follows a
journaled one again, ``Embed`` embeds.

Status codes follow the HTTP server's choices: UNAVAILABLE (503) while loading or draining, RESOURCE_EXHAUSTED (429)
with ``retry-after`` trailing metadata when too many requests are active, INVALID_ARGUMENT (400), NOT_FOUND (404)
for another model, DEADLINE_EXCEEDED (504) past ``request_timeout_s``. A cancelled call (client gone or its
deadline passed) cancels the handler's task; leaving the engine's stream then aborts the request and frees its
KV blocks.

With a request journal (``--state-dir``) ``Generate`` goes through the same machinery as the HTTP routes: the request
is journaled before its first message, produced by a task of the main event loop (the HTTP server's, which owns the
journaled requests) and followed from there; every message carries an ``event_id``, and a client that lost its
call, even to a server restart, calls ``Resume`` with the request id and the last event id it got. Leaving the call
then does not abort the request.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import secrets

import grpc

from rtxcore.engine.async_engine import AsyncEngine
from rtxcore.errors import AdmissionRefused, InvalidRequestError, RtxError
from rtxcore.lanes import DEFAULT_LANE, check_lane_name
from rtxcore.metrics.timeline import TraceHeaders
from rtxcore.sampling_params import SamplingParams
from rtxcore.server.durable.entry import DurableRequest
from rtxcore.server.durable.journal import JournalClosed
from rtxcore.server.grpc.codegen import ensure_generated
from rtxcore.server.grpc.messages import prompt_from, response_from_event, response_from_output, sampling_params_from
from rtxcore.server.http.auth import presented_key
from rtxcore.server.http.common import Route
from rtxcore.server.http.errors import APIError
from rtxcore.server.http.formats import ResponseSpec
from rtxcore.server.http.generation import Generation, tokenize
from rtxcore.server.http.protocol import MAX_BATCH
from rtxcore.server.http.responding import RTX_REQUEST_ID_HEADER, Started, begin
from rtxcore.server.runtime import ServingRuntime
from rtxcore.server.tenants import AuthError, Lease, NotEntitled, RateLimited, Tenant, cache_salt

ensure_generated()
from rtxcore._generated import rtx_pb2, rtx_pb2_grpc  # noqa: E402


# Metadata keys naming the request's lane and prefix-cache salt (as the HTTP header and body field do).
LANE_METADATA = "x-rtx-lane"
CACHE_SALT_METADATA = "x-rtx-cache-salt"

SERVICE_NAME = rtx_pb2.DESCRIPTOR.services_by_name["Rtx"].full_name
# Seconds a client is told to wait before retrying when the server is full or still loading.
RETRY_AFTER_S = 1

# gRPC status for the ``type`` of an error a journaled request ended with (the HTTP error's OpenAI type).
_STATUS_FOR_ERROR_TYPE = {
    "invalid_request_error": grpc.StatusCode.INVALID_ARGUMENT,
    "authentication_error": grpc.StatusCode.UNAUTHENTICATED,
    "permission_error": grpc.StatusCode.PERMISSION_DENIED,
    "not_found_error": grpc.StatusCode.NOT_FOUND,
    "rate_limit_error": grpc.StatusCode.RESOURCE_EXHAUSTED,
    "service_unavailable_error": grpc.StatusCode.UNAVAILABLE,
    "timeout_error": grpc.StatusCode.DEADLINE_EXCEEDED,
}

class RtxServicer(rtx_pb2_grpc.RtxServicer):
    def __init__(self, runtime: ServingRuntime):
        self.runtime = runtime

    async def Generate(self, request: rtx_pb2.GenerateRequest, context: grpc.aio.ServicerContext) -> None:
        engine = await self._engine(context, request.model)
        metadata = dict(context.invocation_metadata() or ())
        tenant = await self._authenticate(context, metadata)
        try:
            prompt = prompt_from(request)
            params = sampling_params_from(request)
            lane = check_lane_name(metadata.get(LANE_METADATA) or (tenant.default_lane if tenant else DEFAULT_LANE),
                                   param=LANE_METADATA)
            if tenant is not None:
                lane = tenant.lane_for(lane)
        except InvalidRequestError as exc:
            await _abort_invalid(context, exc)
        except NotEntitled as exc:
            self.runtime.metrics.record_rejection("not_entitled", lane=lane, tenant=tenant.name)
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, str(exc))
        tokenizer = engine.core.tokenizer
        if isinstance(prompt, str) and prompt and tokenizer is not None:
            # Off the event loop and off the engine thread: a long prompt takes a while to encode.
            prompt = await asyncio.to_thread(tokenizer.encode, prompt)
        trace = TraceHeaders.received(metadata.get("traceparent"), metadata.get("tracestate"))
        if self.runtime.durable is not None and self.runtime.main_loop is not None:
            route = Route(tenant, lane, cache_salt(tenant, metadata.get(CACHE_SALT_METADATA)))
            await self._generate_journaled(context, prompt, params, route, request.request_id, trace)
            return
        tenant_name = tenant.name if tenant is not None else None
        num_prompt_tokens = len(prompt) if isinstance(prompt, list) else 0
        lease = await self._lease_and_admit(context, tenant, num_prompt_tokens + params.max_tokens, lane)
        # The engine's id is the server's own: a client's id, shared by every tenant's clients, would let one
        # tenant find out or block another's ids (as HTTP, which makes its engine ids unique the same way).
        req_id = f"grpc-{secrets.token_hex(12)}"
        self.runtime.metrics.annotate(req_id, trace.traceparent, trace.tracestate,
                                      request_id=request.request_id or req_id, protocol="grpc", lane=lane,
                                      tenant=tenant_name or "")
        stream = engine.generate(prompt, params, req_id=req_id,
                                 cache_salt=cache_salt(tenant, metadata.get(CACHE_SALT_METADATA)), lane=lane,
                                 tenant=tenant_name)
        accepted = False
        used = num_prompt_tokens
        try:
            async with self._statuses_for_errors(context, lane, tenant_name):
                async for out in stream:
                    if not accepted:
                        accepted = True
                        self.runtime.metrics.record_admission(lane, tenant_name)
                    used = out.num_prompt_tokens + out.num_output_tokens
                    await context.write(response_from_output(out, request.request_id or req_id))
        finally:
            # On cancellation or any error this leaves the stream early, which aborts the engine's request.
            await stream.aclose()
            self.runtime.release()
            self.runtime.tenants.release(lease, used)
            if not accepted:
                self.runtime.metrics.forget(req_id)

    async def Resume(self, request: rtx_pb2.ResumeRequest, context: grpc.aio.ServicerContext) -> None:
        await self._engine(context, "")
        tenant = await self._authenticate(context, dict(context.invocation_metadata() or ()))
        main = await self._journal_loop(context)
        req_id, after = request.request_id, request.after_event_id
        entry = await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(
            _find(self.runtime, req_id, tenant.name if tenant is not None else None), main))
        if entry is None:
            await context.abort(grpc.StatusCode.NOT_FOUND,
                                f"no request {req_id!r}: unknown, or finished longer ago than the retention window "
                                f"({self.runtime.durable.options.retention_s:g}s)",
                                trailing_metadata=(("rtx-param", "request_id"),))
        if entry.kind != "grpc":
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                f"request {req_id!r} was made over HTTP: resume it with GET /v1/streams/{req_id}")
        if after > entry.last_seq:
            await context.abort(grpc.StatusCode.OUT_OF_RANGE,
                                f"after_event_id {after}: request {req_id!r} has sent {entry.last_seq} messages so far",
                                trailing_metadata=(("rtx-param", "after_event_id"),))
        main.call_soon_threadsafe(_count_resume, self.runtime)
        await context.send_initial_metadata(((RTX_REQUEST_ID_HEADER, entry.req_id),))
        await self._follow(context, entry, after)

    async def _generate_journaled(self, context: grpc.aio.ServicerContext, prompt: str | list[int],
                                  params: SamplingParams, route: Route, client_req_id: str,
                                  trace: TraceHeaders) -> None:
        main = await self._journal_loop(context)
        try:
            prompts = await tokenize(self.runtime.async_engine.inputs, [prompt])
        except InvalidRequestError as exc:
            await _abort_invalid(context, exc)
        req_id = client_req_id or f"grpc-{secrets.token_hex(12)}"
        starting = _start_journaled(self.runtime, req_id, prompts, params, trace, route)
        try:
            future = asyncio.run_coroutine_threadsafe(starting, main)
        except RuntimeError:  # the main loop has closed
            starting.close()
            await _abort_shutting_down(context)
        try:
            entry = await asyncio.wrap_future(future)
        except APIError as exc:
            await _abort_api_error(context, exc)
        except JournalClosed:
            await _abort_shutting_down(context)
        except RtxError as exc:  # the engine failed
            await context.abort(grpc.StatusCode.INTERNAL, str(exc))
        except OSError as exc:  # the journal's disk failed: the request was not accepted
            await context.abort(grpc.StatusCode.INTERNAL, f"the request journal could not be written: {exc}")
        await context.send_initial_metadata(((RTX_REQUEST_ID_HEADER, entry.req_id),))
        await self._follow(context, entry, 0)

    async def _journal_loop(self, context: grpc.aio.ServicerContext) -> asyncio.AbstractEventLoop:
        """The loop that owns the journaled requests, once the journal has been replayed."""
        runtime = self.runtime
        if runtime.durable is None or runtime.main_loop is None:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                "resumable requests need a server started by `rtx serve --state-dir` (a request "
                                "journal)")
        if not runtime.durable.recovered:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the server is resuming its journaled requests",
                                trailing_metadata=(("retry-after", str(RETRY_AFTER_S)),))
        return runtime.main_loop

    async def _follow(self, context: grpc.aio.ServicerContext, entry: DurableRequest, after: int) -> None:
        """Send ``entry``'s messages after event ``after`` as the main loop publishes them, until it finishes.
        Leaving (the call cancelled) stops only the following: the request runs on."""
        here = asyncio.get_running_loop()
        events: asyncio.Queue = asyncio.Queue()

        def put(item) -> None:
            with contextlib.suppress(RuntimeError):  # this loop has closed: nobody is listening
                here.call_soon_threadsafe(events.put_nowait, item)

        async def pump() -> None:
            try:
                async for seq, payload in entry.follow(after):
                    put((seq, payload))
            finally:
                put(None)

        pumping = asyncio.run_coroutine_threadsafe(pump(), self.runtime.main_loop)
        try:
            while (item := await events.get()) is not None:
                seq, payload = item
                event = json.loads(payload)
                if "error" in event:
                    error = event["error"]
                    await context.abort(_STATUS_FOR_ERROR_TYPE.get(error.get("type"), grpc.StatusCode.INTERNAL),
                                        error.get("message", "the request failed"))
                await context.write(response_from_event(entry.req_id, seq, event))
        finally:
            pumping.cancel()
        if not entry.finished:  # abandoned: the server is shutting down
            await context.abort(grpc.StatusCode.UNAVAILABLE,
                                f"the server stopped before request {entry.req_id} finished; it is in the journal: "
                                f"call Resume with after_event_id = the last event_id you got once the server is back",
                                trailing_metadata=(("retry-after", str(RETRY_AFTER_S)),))

    async def Embed(self, request: rtx_pb2.EmbedRequest, context: grpc.aio.ServicerContext) -> rtx_pb2.EmbedResponse:
        engine = await self._engine(context, request.model)
        tenant = await self._authenticate(context, dict(context.invocation_metadata() or ()))
        inputs = [*request.inputs, *(list(t.ids) for t in request.token_inputs)]
        if not inputs:
            await _abort_invalid(context, InvalidRequestError("inputs must hold at least one input", param="inputs"))
        if len(inputs) > MAX_BATCH:  # one call runs as one job on the engine thread, holding up every stream
            await _abort_invalid(context, InvalidRequestError(
                f"inputs hold {len(inputs)} items; at most {MAX_BATCH} are accepted", param="inputs"))
        try:
            token_lists = await tokenize(engine.inputs, inputs, "inputs")
        except InvalidRequestError as exc:
            await _abort_invalid(context, exc)
        num_tokens = sum(len(t) for t in token_lists)
        lease = await self._lease_and_admit(context, tenant, num_tokens)
        try:
            async with self._statuses_for_errors(context):
                vectors = await engine.embed(token_lists)
        finally:
            self.runtime.release()
            self.runtime.tenants.release(lease, num_tokens)
        return rtx_pb2.EmbedResponse(embeddings=[rtx_pb2.Embedding(values=v) for v in vectors],
                                     model=self.runtime.model_name, prompt_tokens=num_tokens)

    @contextlib.asynccontextmanager
    async def _statuses_for_errors(self, context: grpc.aio.ServicerContext, lane: str | None = None,
                                   tenant: str | None = None):
        """Run the body under the request timeout and turn rtx errors into gRPC statuses (context.abort raises)."""
        timeout_s = self.runtime.settings.request_timeout_s
        try:
            async with asyncio.timeout(timeout_s):
                yield
        except AdmissionRefused as exc:
            self.runtime.metrics.record_rejection(exc.code, lane=lane, tenant=tenant)
            await _abort_retry_later(context, str(exc), exc.retry_after_s)
        except InvalidRequestError as exc:
            await _abort_invalid(context, exc)
        except TimeoutError:
            self.runtime.metrics.record_timeout()
            await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, f"request timed out after {timeout_s:g}s")
        except RtxError as exc:
            await context.abort(grpc.StatusCode.INTERNAL, str(exc))

    async def _engine(self, context: grpc.aio.ServicerContext, model: str) -> AsyncEngine:
        """The running engine, or abort the call with the status that tells the client why not (and when to
        retry), as the HTTP server's 503 and 404 do."""
        runtime = self.runtime
        retry = (("retry-after", str(RETRY_AFTER_S)),)
        if runtime.draining:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the server is shutting down", trailing_metadata=retry)
        engine = runtime.async_engine
        if engine is None:
            if runtime.load_error is not None:
                await context.abort(grpc.StatusCode.UNAVAILABLE, f"the model failed to load: {runtime.load_error}")
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the model is still loading", trailing_metadata=retry)
        if not engine.is_running:
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"the engine has stopped: {engine.error!r}")
        if model and model not in runtime.model_aliases:
            await context.abort(grpc.StatusCode.NOT_FOUND,
                                f"model {model!r} does not exist; this server serves {runtime.model_name!r}",
                                trailing_metadata=(("rtx-param", "model"),))
        return engine

    async def _authenticate(self, context: grpc.aio.ServicerContext, metadata: dict) -> Tenant | None:
        """The caller's tenant from its ``authorization: Bearer`` (or ``x-api-key``) metadata, or UNAUTHENTICATED."""
        try:
            return self.runtime.tenants.authenticate(presented_key(metadata.get("authorization"),
                                                                   metadata.get("x-api-key")))
        except AuthError as exc:
            self.runtime.metrics.record_rejection("unauthorized")
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, str(exc))

    async def _lease_and_admit(self, context: grpc.aio.ServicerContext, tenant: Tenant | None, num_tokens: int,
                               lane: str | None = None) -> Lease:
        """Take one request and ``num_tokens`` from the tenant's limits, then an admission slot; or abort with
        RESOURCE_EXHAUSTED, holding neither."""
        try:
            lease = self.runtime.tenants.acquire(tenant, 1, num_tokens)
        except RateLimited as exc:
            self.runtime.metrics.record_rejection(exc.code, lane=lane,
                                                  tenant=tenant.name if tenant is not None else None)
            await _abort_retry_later(context, str(exc), exc.retry_after_s)
        except InvalidRequestError as exc:  # larger than the tenant's limits allow
            await _abort_invalid(context, exc)
        try:
            await self._admit(context)
        except BaseException:
            self.runtime.tenants.release(lease, 0)
            raise
        return lease

    async def _admit(self, context: grpc.aio.ServicerContext) -> None:
        """Take an admission slot (give it back with ``runtime.release()``) or abort with RESOURCE_EXHAUSTED."""
        runtime = self.runtime
        if not runtime.try_admit():
            runtime.metrics.record_rejection("overloaded")
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                f"the server is at its limit of {runtime.settings.max_active_requests} active "
                                "requests; retry later", trailing_metadata=(("retry-after", str(RETRY_AFTER_S)),))


async def _start_journaled(runtime: ServingRuntime, req_id: str, prompts: list[list[int]], params: SamplingParams,
                           trace: TraceHeaders, route: Route) -> DurableRequest:
    """Admit, journal and start a gRPC request; on the main loop."""
    gen = await Generation.start(runtime, req_id, prompts, params, trace, route, protocol="grpc")
    spec = ResponseSpec("grpc", True, {"id": gen.req_id, "model": runtime.model_name},
                        logprobs=params.logprobs is not None)
    return await begin(runtime, Started(gen, spec, prompts, params), None)


async def _find(runtime: ServingRuntime, req_id: str, tenant: str | None) -> DurableRequest | None:
    """The journaled request ``tenant`` made; on the main loop, which owns them."""
    return runtime.durable.get(req_id, tenant)


def _count_resume(runtime: ServingRuntime) -> None:
    runtime.durable.stats.num_stream_resumes += 1


async def _abort_shutting_down(context: grpc.aio.ServicerContext) -> None:
    await context.abort(grpc.StatusCode.UNAVAILABLE, "the server is shutting down",
                        trailing_metadata=(("retry-after", str(RETRY_AFTER_S)),))


async def _abort_api_error(context: grpc.aio.ServicerContext, exc: APIError) -> None:
    """The gRPC status for an error the HTTP machinery raised while admitting a request."""
    error = exc.body()["error"]
    metadata = []
    if "Retry-After" in exc.headers:
        metadata.append(("retry-after", exc.headers["Retry-After"]))
    if exc.param:
        metadata.append(("rtx-param", exc.param))
    await context.abort(_STATUS_FOR_ERROR_TYPE.get(error["type"], grpc.StatusCode.INTERNAL), exc.message,
                        trailing_metadata=tuple(metadata))


async def _abort_retry_later(context: grpc.aio.ServicerContext, message: str, retry_after_s: float) -> None:
    await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, message,
                        trailing_metadata=(("retry-after", str(max(1, math.ceil(retry_after_s)))),))


async def _abort_invalid(context: grpc.aio.ServicerContext, exc: InvalidRequestError) -> None:
    metadata = (("rtx-param", exc.param),) if exc.param else ()
    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc), trailing_metadata=metadata)
