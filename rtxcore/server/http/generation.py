"""One HTTP request's trip through the engine: admission, tokenization, submission, streaming, timeout and abort.

A request with several prompts becomes one engine request per prompt; :class:`Generation` merges their outputs
into one stream of ``(choice, output)``. Whatever ends it (finished, client gone, timeout, error),
:meth:`Generation.close` aborts what is still running and gives back its admission slots.
"""

from __future__ import annotations

import asyncio
import itertools
from collections import deque
from dataclasses import dataclass, field
from typing import AsyncIterator, Awaitable, Callable, TypeVar

from starlette.requests import Request

from rtxcore.engine.async_engine import AsyncEngine
from rtxcore.engine.input_processor import InputProcessor
from rtxcore.engine.outputs import RequestOutput, TokenLogprob
from rtxcore.errors import AdmissionRefused, InvalidRequestError
from rtxcore.metrics.timeline import TraceHeaders
from rtxcore.sampling_params import SamplingParams
from rtxcore.server.http.common import Route
from rtxcore.server.http.errors import APIError, not_ready, overloaded, too_many_requests
from rtxcore.server.http.protocol import Prompt
from rtxcore.server.runtime import ServingRuntime
from rtxcore.server.tenants import Lease, RateLimited

T = TypeVar("T")

_submissions = itertools.count()


class ClientGone(Exception):
    """The client disconnected before its response was ready."""


@dataclass(slots=True)
class Choice:
    """What one engine request has produced so far."""

    index: int
    num_prompt_tokens: int
    text: str = ""
    num_tokens: int = 0
    # Prompt tokens found in the prefix cache.
    num_cached_tokens: int = 0
    finish_reason: str | None = None
    logprobs: list[TokenLogprob] = field(default_factory=list)

    def add(self, out: RequestOutput) -> None:
        # A request resumed after a restart prefills its earlier output too: only the prompt's part counts here.
        self.num_cached_tokens = min(out.num_cached_tokens, self.num_prompt_tokens)
        self.text += out.new_text
        self.num_tokens += len(out.new_token_ids)
        if out.logprobs:
            self.logprobs.extend(out.logprobs)
        if out.finished:
            self.finish_reason = out.finish_reason


async def tokenize(inputs: InputProcessor, prompts: list[Prompt], param: str = "prompt") -> list[list[int]]:
    """Token ids of every prompt, text encoded off the event loop (a long prompt takes a while)."""
    if not any(isinstance(p, str) for p in prompts):
        return inputs.encode_batch(prompts, param)
    return await asyncio.to_thread(inputs.encode_batch, prompts, param)


class Generation:
    def __init__(self, runtime: ServingRuntime, req_id: str, prompts: list[list[int]], params: SamplingParams,
                 trace: TraceHeaders, route: Route, lease: Lease, resumed: list[Choice] | None = None,
                 resumed_token_ids: list[list[int]] | None = None, protocol: str = "http"):
        """:param resumed: the choices as a journal left them (a request resumed after a restart); finished ones
            are not run again, the others go on after ``resumed_token_ids``, their tokens so far.
        :param protocol: "http" or "grpc", for the requests' traces."""
        assert runtime.async_engine is not None
        self.runtime = runtime
        self.req_id = req_id
        self.route = route
        self.trace = trace
        self._lease = lease
        self.choices = resumed or [Choice(i, len(p)) for i, p in enumerate(prompts)]
        outputs_so_far = resumed_token_ids or [[] for _ in prompts]
        running = [i for i, c in enumerate(self.choices) if c.finish_reason is None]
        self.deadline = asyncio.get_running_loop().time() + runtime.settings.request_timeout_s
        self._engine = runtime.async_engine
        # Unique even when clients reuse a request id.
        base = f"{req_id}.{next(_submissions)}"
        self._req_ids = [f"{base}-{i}" for i in range(len(prompts))]
        for engine_req_id in (self._req_ids[i] for i in running):
            runtime.metrics.annotate(engine_req_id, trace.traceparent, trace.tracestate, request_id=req_id,
                                     protocol=protocol, lane=route.lane, tenant=route.tenant_name or "")
        self._queue: asyncio.Queue[tuple[int, RequestOutput | BaseException]] = asyncio.Queue()
        self._buffer: deque[tuple[int, RequestOutput | BaseException]] = deque()
        self._tasks = [asyncio.ensure_future(self._pump(i, prompts[i], params, outputs_so_far[i])) for i in running]
        self._num_running = len(running)
        self._num_finished = len(self.choices) - len(running)
        self._closed = False

    @classmethod
    async def start(cls, runtime: ServingRuntime, req_id: str, prompts: list[list[int]], params: SamplingParams,
                    trace: TraceHeaders, route: Route, protocol: str = "http") -> Generation:
        """Admit and submit; returns once the engine has accepted every prompt (so errors are still 4xx).

        :raises APIError: 429 when the server, the tenant's limits or the lane are full, 400 when the engine
            refuses a prompt, 504 on timeout.
        """
        metrics = runtime.metrics
        try:
            lease = runtime.tenants.acquire(route.tenant, len(prompts),
                                            sum(len(p) for p in prompts) + params.max_tokens * len(prompts))
        except RateLimited as exc:
            metrics.record_rejection(exc.code, lane=route.lane, tenant=route.tenant_name)
            raise too_many_requests(str(exc), exc.retry_after_s, "rate_limited") from None
        except InvalidRequestError as exc:  # larger than the tenant's limits allow
            raise APIError.invalid(exc) from None
        if not runtime.try_admit(len(prompts)):
            runtime.tenants.release(lease, 0)
            metrics.record_rejection("overloaded", lane=route.lane, tenant=route.tenant_name)
            raise overloaded(runtime.settings.max_active_requests)
        gen = cls(runtime, req_id, prompts, params, trace, route, lease, protocol=protocol)
        try:
            await gen._wait_accepted()
        except AdmissionRefused as exc:
            gen.close()
            metrics.record_rejection(exc.code, lane=route.lane, tenant=route.tenant_name)
            raise too_many_requests(str(exc), exc.retry_after_s, exc.code) from None
        except InvalidRequestError as exc:
            gen.close()
            raise APIError.invalid(exc) from None
        except TimeoutError:
            gen.close()
            raise gen.timeout_error() from None
        except BaseException:
            gen.close()
            raise
        metrics.record_admission(route.lane, route.tenant_name, len(prompts))
        return gen

    @classmethod
    async def resume(cls, runtime: ServingRuntime, req_id: str, prompts: list[list[int]], params: SamplingParams,
                     route: Route, choices: list[Choice], token_ids: list[list[int]], protocol: str = "http",
                     trace: TraceHeaders = TraceHeaders()) -> Generation:
        """Go on with a request accepted before a restart. It was admitted then: tenant limits and the server's
        request limit do not refuse it now (it counts towards them, not against them). It is traced under the trace
        it came with.

        :raises AdmissionRefused: the scheduler cannot take it yet (the caller retries).
        :raises InvalidRequestError: the engine can no longer run it (another model or context).
        """
        runtime.force_admit(len(prompts))
        # Reserved as a new request would be: the whole of each prompt plus max_tokens (the buckets started anew).
        lease = runtime.tenants.take(route.tenant, len(prompts), sum(len(p) + params.max_tokens for p in prompts))
        gen = cls(runtime, req_id, prompts, params, trace, route, lease, choices, token_ids, protocol)
        try:
            await gen._wait_accepted()
        except BaseException:
            # Not run (the caller retries): all of its reservation goes back. close() would count the tokens made
            # before the restart as used, and each retry would take them from the tenant again.
            runtime.tenants.release(lease, 0)
            gen.close()
            raise
        return gen

    def usage(self) -> dict[str, object]:
        prompt = sum(c.num_prompt_tokens for c in self.choices)
        completion = sum(c.num_tokens for c in self.choices)
        cached = sum(c.num_cached_tokens for c in self.choices)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
                "prompt_tokens_details": {"cached_tokens": cached}}

    def timeout_error(self) -> APIError:
        self.runtime.metrics.record_timeout()
        return APIError(504, f"request timed out after {self.runtime.settings.request_timeout_s:g}s")

    async def outputs(self) -> AsyncIterator[tuple[Choice, RequestOutput]]:
        """Every output of every choice as it comes, until all are finished.

        :raises TimeoutError: past the request timeout (the engine requests are aborted).
        """
        try:
            while self._num_finished < len(self.choices):
                index, item = self._buffer.popleft() if self._buffer else await self._get()
                if isinstance(item, BaseException):
                    raise item
                if item.finished:
                    self._num_finished += 1
                choice = self.choices[index]
                choice.add(item)
                yield choice, item
        finally:
            self.close()

    def close(self) -> None:
        """Abort whatever still runs and give back the admission slots; safe to call more than once."""
        if self._closed:
            return
        self._closed = True
        for task in self._tasks:
            task.cancel()
        self.runtime.release(len(self.choices))
        self.runtime.tenants.release(self._lease, sum(c.num_prompt_tokens + c.num_tokens for c in self.choices))

    # -- internals ----------------------------------------------------------------------------------------------

    async def _pump(self, index: int, prompt: list[int], params: SamplingParams, token_ids: list[int]) -> None:
        req_id = self._req_ids[index]
        try:
            route = self.route
            async for out in self._engine.generate(prompt, params, req_id=req_id, cache_salt=route.cache_salt,
                                                   lane=route.lane, tenant=route.tenant_name,
                                                   output_token_ids=token_ids):
                self._queue.put_nowait((index, out))
        except asyncio.CancelledError:
            raise  # generate() aborts what it submitted, also when cancelled before the engine took it
        except BaseException as exc:
            self.runtime.metrics.forget(req_id)  # refused by the engine: no timeline will claim the annotation
            self._queue.put_nowait((index, exc))

    async def _wait_accepted(self) -> None:
        """Buffer outputs until each prompt has produced one (or an error, which is raised)."""
        seen: set[int] = set()
        while len(seen) < self._num_running:
            index, item = await self._get()
            self._buffer.append((index, item))
            seen.add(index)
            if isinstance(item, BaseException):
                raise item

    async def _get(self) -> tuple[int, RequestOutput | BaseException]:
        async with asyncio.timeout_at(self.deadline):
            return await self._queue.get()


async def embed(runtime: ServingRuntime, request: Request, token_lists: list[list[int]]) -> list[list[float]]:
    """Embeddings computed on the engine thread between two steps, within the request timeout."""
    tenant = request.state.tenant
    num_tokens = sum(len(t) for t in token_lists)
    try:
        lease = runtime.tenants.acquire(tenant, 1, num_tokens)
    except RateLimited as exc:
        runtime.metrics.record_rejection(exc.code, tenant=tenant.name if tenant is not None else None)
        raise too_many_requests(str(exc), exc.retry_after_s, "rate_limited") from None
    if not runtime.try_admit(1):
        runtime.tenants.release(lease, 0)
        runtime.metrics.record_rejection("overloaded")
        raise overloaded(runtime.settings.max_active_requests)
    try:
        async with asyncio.timeout(runtime.settings.request_timeout_s):
            return await until_disconnected(request, runtime.async_engine.embed(token_lists))
    except TimeoutError:
        runtime.metrics.record_timeout()
        raise APIError(504, f"request timed out after {runtime.settings.request_timeout_s:g}s") from None
    finally:
        runtime.release(1)
        runtime.tenants.release(lease, num_tokens)


async def until_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Await ``work``, cancelling it if the client disconnects first.

    :raises ClientGone: the client went away (``work`` has been cancelled).
    """
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(_wait_for_disconnect(request.receive))
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not task.done():
            task.cancel()
    if not task.done() or task.cancelled():
        raise ClientGone()
    return task.result()


async def _wait_for_disconnect(receive: Callable) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


def ensure_engine(runtime: ServingRuntime) -> AsyncEngine:
    """The running engine; raises 503 while loading, draining, or after the engine failed."""
    if runtime.draining:
        raise not_ready("the server is shutting down")
    engine = runtime.async_engine
    if engine is None:
        if runtime.load_error is not None:
            raise APIError(503, f"the model failed to load: {runtime.load_error}")
        raise not_ready("the model is still loading")
    if not engine.is_running:
        raise APIError(503, f"the engine has stopped: {engine.error!r}")
    if runtime.durable is not None and not runtime.durable.recovered:
        raise not_ready("resuming the requests of the journal")
    return engine
