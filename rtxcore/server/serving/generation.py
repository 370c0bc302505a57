"""One request's trip through the engine, whatever its protocol: admission, tokenization, submission, streaming,
timeout and abort.

A request with several prompts, or several choices per prompt (``n``), becomes one engine request per choice;
:class:`Generation` merges their outputs into one stream of ``(choice, output)``. Whatever ends it (finished, client
gone, timeout, error), :meth:`Generation.close` aborts what is still running and gives back its admission slots.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import time
from collections import deque
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from rtxcore.engine.input_processor import InputProcessor, Prompt
from rtxcore.engine.outputs import RequestOutput, TokenLogprob
from rtxcore.errors import AdmissionRefused, ErrorCode, RequestError
from rtxcore.metrics.timeline import TraceHeaders
from rtxcore.sampling_params import SamplingParams
from rtxcore.server.serving.limits import RETRY_AFTER_S
from rtxcore.server.serving.routing import Route
from rtxcore.server.serving.runtime import ServingRuntime
from rtxcore.server.serving.tenants import Lease, RateLimited
from rtxcore.tokenizer import Tokenizer

_submissions = itertools.count()


@dataclass(slots=True, frozen=True)
class Speculation:
    """What a request asks of speculative decoding: the same for each of its prompts, and journaled with it so a
    request resumed after a restart keeps it."""

    # The output the caller expects (OpenAI ``prediction``, ``draft_token_ids``), proposed to the engine and
    # verified: it changes how fast the output comes, never what it is. None: no prediction.
    draft_token_ids: list[int] | None = None
    # False: the request never speculates (the per-request opt-out).
    enabled: bool = True

    def to_json(self) -> dict[str, Any]:
        return {"draft_token_ids": self.draft_token_ids, "speculative": self.enabled}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Speculation:
        """From :meth:`to_json`'s keys in ``data``; a record written before they existed gives the defaults."""
        draft_token_ids = data.get("draft_token_ids")
        return cls(list(draft_token_ids) if draft_token_ids is not None else None,
                   bool(data.get("speculative", True)))


NO_SPECULATION = Speculation()


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
    # Of the caller's prediction: tokens the model accepted and refused (known once finished).
    num_accepted_prediction_tokens: int = 0
    num_rejected_prediction_tokens: int = 0

    def add(self, out: RequestOutput) -> None:
        # A request resumed after a restart prefills its earlier output too: only the prompt's part counts here.
        self.num_cached_tokens = min(out.num_cached_tokens, self.num_prompt_tokens)
        self.text += out.new_text
        self.num_tokens += len(out.new_token_ids)
        if out.logprobs:
            self.logprobs.extend(out.logprobs)
        if out.finished:
            self.finish_reason = out.finish_reason
            self.num_accepted_prediction_tokens = out.num_accepted_prediction_tokens
            self.num_rejected_prediction_tokens = out.num_rejected_prediction_tokens


async def tokenize(inputs: InputProcessor, prompts: Sequence[Prompt], param: str = "prompt") -> list[list[int]]:
    """Token ids of every prompt, text encoded off the event loop (a long prompt takes a while)."""
    if not any(isinstance(p, str) for p in prompts):
        return inputs.encode_batch(prompts, param)
    return await asyncio.to_thread(inputs.encode_batch, prompts, param)


async def encode_prediction(inputs: InputProcessor, text: str | None) -> list[int] | None:
    """Draft token ids of a predicted output given as text (None or empty: none), encoded off the event loop: a
    prediction is typically a whole document.

    :raises InvalidRequestError: naming ``prediction``."""
    if not text:
        return None
    return await asyncio.to_thread(inputs.encode_prediction, text)


class Generation:
    def __init__(self, runtime: ServingRuntime, req_id: str, prompts: list[list[int]], params: SamplingParams,
                 trace: TraceHeaders, route: Route, lease: Lease, resumed: list[Choice] | None = None,
                 resumed_token_ids: list[list[int]] | None = None, protocol: str = "http",
                 speculation: Speculation = NO_SPECULATION, n: int = 1, received_at: float | None = None):
        """:param prompts: one per prompt; each gives ``n`` choices, those of prompt ``i`` numbered ``i * n`` to
            ``i * n + n - 1`` (OpenAI's order).
        :param resumed: the choices as a journal left them (a request resumed after a restart); finished ones
            are not run again, the others go on after ``resumed_token_ids``, their tokens so far.
        :param protocol: "http" or "grpc", for the requests' traces.
        :param speculation: applies to every prompt.
        :param n: choices per prompt (see :func:`choice_params` for how they differ).
        :param received_at: when the server got the request (time.monotonic()); each choice's time outside the engine
            before its first token is then recorded (rtxcore.capacity.serving_path)."""
        assert runtime.async_engine is not None
        self.runtime = runtime
        self.req_id = req_id
        self.route = route
        self.trace = trace
        self.speculation = speculation
        self._lease = lease
        self.n = n
        prompts = [p for p in prompts for _ in range(n)]
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
        self._tasks = [asyncio.ensure_future(self._pump(i, prompts[i], choice_params(params, i % n), outputs_so_far[i]))
                       for i in running]
        self._num_running = len(running)
        self._num_finished = len(self.choices) - len(running)
        self._closed = False
        self._received_at = received_at
        # Per choice: when it was submitted to the engine and when its first token reached the event loop.
        self._submitted_at: dict[int, float] = {}
        self._first_token_at: dict[int, float] = {}

    @classmethod
    async def start(cls, runtime: ServingRuntime, req_id: str, prompts: list[list[int]], params: SamplingParams,
                    trace: TraceHeaders, route: Route, protocol: str = "http",
                    speculation: Speculation = NO_SPECULATION, n: int = 1,
                    received_at: float | None = None) -> Generation:
        """Admit and submit; returns once the engine has accepted every prompt (so errors are still 4xx).

        :raises RequestError: RESOURCE_EXHAUSTED when the server, the tenant's limits or the lane are full,
            INVALID_ARGUMENT when the engine refuses a prompt (or it is larger than the tenant's limits allow),
            DEADLINE_EXCEEDED on timeout.
        """
        metrics = runtime.metrics
        num_choices = len(prompts) * n
        try:
            lease = runtime.tenants.acquire(route.tenant, num_choices,
                                            n * sum(len(p) for p in prompts) + params.max_tokens * num_choices,
                                            requests_param="n" if n > 1 and len(prompts) == 1 else "prompt")
        except RateLimited as exc:
            metrics.record_rejection(exc.limit, lane=route.lane, tenant=route.tenant_name)
            raise
        if not runtime.try_admit(num_choices):
            runtime.tenants.release(lease, 0)
            metrics.record_rejection("overloaded", lane=route.lane, tenant=route.tenant_name)
            raise overloaded(runtime.settings.max_active_requests)
        gen = cls(runtime, req_id, prompts, params, trace, route, lease, protocol=protocol, speculation=speculation,
                  n=n, received_at=received_at)
        try:
            await gen._wait_accepted()
        except AdmissionRefused as exc:
            gen.close()
            metrics.record_rejection(exc.reason or "refused", lane=route.lane, tenant=route.tenant_name)
            raise
        except TimeoutError:
            gen.close()
            raise gen.timeout_error() from None
        except BaseException:
            gen.close()
            raise
        metrics.record_admission(route.lane, route.tenant_name, num_choices)
        return gen

    @classmethod
    async def resume(cls, runtime: ServingRuntime, req_id: str, prompts: list[list[int]], params: SamplingParams,
                     route: Route, choices: list[Choice], token_ids: list[list[int]], trace: TraceHeaders,
                     protocol: str = "http", speculation: Speculation = NO_SPECULATION, n: int = 1) -> Generation:
        """Go on with a request accepted before a restart. It was admitted then: tenant limits and the server's
        request limit do not refuse it now (it counts towards them, not against them). It is traced under the trace
        it came with.

        :raises AdmissionRefused: the scheduler cannot take it yet (the caller retries).
        :raises InvalidRequestError: the engine can no longer run it (another model or context).
        """
        runtime.force_admit(len(choices))
        # Reserved as a new request would be: the whole of each prompt plus max_tokens (the buckets started anew).
        lease = runtime.tenants.take(route.tenant, len(choices),
                                     n * sum(len(p) + params.max_tokens for p in prompts))
        gen = cls(runtime, req_id, prompts, params, trace, route, lease, choices, token_ids, protocol, speculation, n)
        try:
            await gen._wait_accepted()
        except BaseException:
            # Not run (the caller retries): all of its reservation goes back. close() would count the tokens made
            # before the restart as used, and each retry would take them from the tenant again.
            runtime.tenants.release(lease, 0)
            gen.close()
            raise
        return gen

    @property
    def tokenizer(self) -> Tokenizer | None:
        """The engine's tokenizer (response formats name tokens with it)."""
        return self._engine.core.tokenizer

    def usage(self) -> dict[str, object]:
        # A prompt counts once however many choices it gives (as OpenAI counts it); its cache hits, its first
        # choice's (the others find the whole prompt cached, which says nothing about the caller's reuse).
        firsts = self.choices[::self.n]
        prompt = sum(c.num_prompt_tokens for c in firsts)
        completion = sum(c.num_tokens for c in self.choices)
        cached = sum(c.num_cached_tokens for c in firsts)
        usage: dict[str, object] = {"prompt_tokens": prompt, "completion_tokens": completion,
                                    "total_tokens": prompt + completion,
                                    "prompt_tokens_details": {"cached_tokens": cached}}
        if self.speculation.draft_token_ids:
            # OpenAI's Predicted Outputs fields: how much of the prediction the model kept and refused.
            usage["completion_tokens_details"] = {
                "accepted_prediction_tokens": sum(c.num_accepted_prediction_tokens for c in self.choices),
                "rejected_prediction_tokens": sum(c.num_rejected_prediction_tokens for c in self.choices)}
        return usage

    def timeout_error(self) -> RequestError:
        self.runtime.metrics.record_timeout()
        return timed_out(self.runtime.settings.request_timeout_s)

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

    async def cancel(self) -> bool:
        """End every choice still running, finished with finish_reason "abort" (its outputs() then ends as for any
        finished generation). Returns whether any was still running."""
        cancelled = await asyncio.gather(*(self._engine.cancel(req_id) for req_id in self._req_ids))
        return any(cancelled)

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

    def _record_serving_path(self, index: int, first_token_time: float | None) -> None:
        submitted, delivered = self._submitted_at.get(index), self._first_token_at.get(index)
        if self._received_at is None or submitted is None or delivered is None or first_token_time is None:
            return  # resumed after a restart, or no token came
        self.runtime.metrics.record_serving_path(submitted - self._received_at, delivered - first_token_time)

    async def _pump(self, index: int, prompt: list[int], params: SamplingParams, token_ids: list[int]) -> None:
        req_id = self._req_ids[index]
        try:
            route, speculation = self.route, self.speculation
            self._submitted_at[index] = time.monotonic()
            async for out in self._engine.generate(prompt, params, req_id=req_id, cache_salt=route.cache_salt,
                                                   lane=route.lane, tenant=route.tenant_name,
                                                   output_token_ids=token_ids,
                                                   draft_token_ids=speculation.draft_token_ids,
                                                   speculative=speculation.enabled):
                if out.new_token_ids and index not in self._first_token_at:
                    self._first_token_at[index] = time.monotonic()
                if out.timings is not None:
                    self._record_serving_path(index, out.timings.first_token_time)
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


def choice_params(params: SamplingParams, choice: int) -> SamplingParams:
    """The parameters of a prompt's ``choice``-th choice. Unseeded choices differ by their random draws; seeded ones
    draw from ``seed + choice``, so that they differ from each other and each is reproducible (a request with
    ``n=3, seed=s`` gives as its choice 2 what ``n=1, seed=s+2`` gives)."""
    if choice == 0 or params.seed is None:
        return params
    return dataclasses.replace(params, seed=(params.seed + choice) % 2**63)


def overloaded(max_active_requests: int) -> RequestError:
    return RequestError(ErrorCode.RESOURCE_EXHAUSTED, f"the server is at its limit of {max_active_requests} active "
                        "requests; retry later", retry_after_s=RETRY_AFTER_S, reason="server_overloaded")


def timed_out(timeout_s: float) -> RequestError:
    return RequestError(ErrorCode.DEADLINE_EXCEEDED, f"request timed out after {timeout_s:g}s", reason="timeout")
