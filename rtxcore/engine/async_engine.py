"""Drive an :class:`EngineCore` from asyncio: one thread steps the engine, coroutines stream each request's outputs.

The core is not thread-safe, so every call into it (add, abort, step) happens on the engine thread. Requests are
checked and encoded by the caller (:class:`InputProcessor`, thread-safe); submissions and aborts are queued and
applied between steps: an abort frees the request's KV blocks before the next step runs.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import functools
import itertools
import logging
import operator
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from rtxcore.engine.core import EngineCore, token_groups
from rtxcore.engine.input_processor import InputProcessor, Prompt
from rtxcore.engine.outputs import RequestFailure, RequestOutput, TokenLogprob
from rtxcore.engine.prompt_scoring import scoring_groups
from rtxcore.errors import EngineFailed, ErrorCode, InvalidRequestError, RequestError, RtxError
from rtxcore.lanes import DEFAULT_LANE
from rtxcore.request import Request
from rtxcore.sampling_params import SamplingParams

log = logging.getLogger("rtx.engine")


@dataclass(slots=True)
class _Submission:
    # Checked by the input processor; the engine thread only queues it.
    req: Request
    sink: Callable[[RequestOutput | BaseException], None]
    accepted: concurrent.futures.Future = field(default_factory=concurrent.futures.Future)
    # When generate() queued it (time.monotonic()); the wait until the engine thread adds it is the merge wait.
    submitted_at: float = field(default_factory=time.monotonic)


@dataclass(slots=True)
class _Abort:
    # Aborts this submission's request only: a client may reuse a finished request's id (gRPC passes client ids
    # through), and a late abort by id alone would stop the newer request.
    sub: _Submission


@dataclass(slots=True)
class _Job:
    # Work that needs the engine between steps (embeddings, inspection); its result or exception goes to ``done``.
    fn: Callable[[EngineCore], object]
    done: concurrent.futures.Future = field(default_factory=concurrent.futures.Future)
    # A forward pass of its own (embedding or scoring a group of prompts): while requests run, one such job runs
    # between two steps, so that a batch of long inputs delays each step by one pass, not by all of them.
    heavy: bool = False


@dataclass(slots=True)
class StepObserver:
    """Callbacks run on the engine thread (metrics hooks): keep them cheap, O(outputs) per call."""

    # After each step: (engine, the step's outputs, the step's duration in seconds).
    on_step: Callable[[EngineCore, list[RequestOutput], float], None]
    # A submission entered the scheduler: (the request, when generate() queued it, when the engine thread added it),
    # both on the time.monotonic() clock.
    on_admit: Callable[[Request, float, float], None] | None = None
    # A request in the engine was aborted: (engine, its final output, whose finish_reason is "abort").
    on_abort: Callable[[EngineCore, RequestOutput], None] | None = None
    # The engine is idle (no request): called every IDLE_TICK_S, so gauges and time-driven state (brownout) move on.
    on_idle: Callable[[EngineCore], None] | None = None
    # The scheduler held a step open to merge arrivals (its merge window): the seconds the engine waited.
    on_hold: Callable[[float], None] | None = None


# How often observers hear from an idle engine.
IDLE_TICK_S = 0.25


class AsyncEngine:
    def __init__(self, core: EngineCore, observers: list[StepObserver] | None = None):
        self.core = core
        # Checks and encodes requests on the caller's thread.
        self.inputs: InputProcessor = core.input_processor()
        self.observers = observers or []
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        # Heavy jobs taken from the inbox, waiting for their turn between steps.
        self._heavy: collections.deque[_Job] = collections.deque()
        self._sinks: dict[str, Callable[[RequestOutput | BaseException], None]] = {}
        self._ids = itertools.count()
        self._wake = threading.Event()
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rtx-engine", daemon=True)
        self.last_step_time = 0.0
        self._last_tick = 0.0
        self.error: BaseException | None = None
        # Set when the loop ends (stopped or failed): what jobs queued from then on end with.
        self._ended: EngineFailed | None = None
        self.num_steps = 0

    # -- lifecycle ------------------------------------------------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        self._stopping.set()
        self._wake.set()
        self._thread.join(timeout)

    @property
    def is_running(self) -> bool:
        return self._thread.is_alive() and self.error is None

    @property
    def num_active(self) -> int:
        return len(self._sinks)

    # -- requests -------------------------------------------------------------------------------------------------

    async def generate(self, prompt: Prompt, params: SamplingParams, req_id: str | None = None,
                       cache_salt: str | None = None, lane: str = DEFAULT_LANE,
                       tenant: str | None = None, output_token_ids: list[int] | None = None,
                       draft_token_ids: Sequence[int] | None = None, speculative: bool = True
                       ) -> AsyncIterator[RequestOutput]:
        """Stream a request's outputs. Validation errors raise before the first output; leaving the iterator early
        (client gone, cancellation) aborts the request. ``output_token_ids`` resumes a request that had produced
        them before a restart: only the outputs after them are streamed. ``draft_token_ids`` and ``speculative``
        are :meth:`InputProcessor.make_request`'s."""
        loop = asyncio.get_running_loop()
        outputs: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        req_id = req_id or f"req-{next(self._ids)}"

        def sink(item: RequestOutput | BaseException) -> None:
            loop.call_soon_threadsafe(outputs.put_nowait, item)

        make = functools.partial(self.inputs.make_request, prompt, params, req_id, cache_salt=cache_salt, lane=lane,
                                 tenant=tenant, output_token_ids=output_token_ids or (),
                                 draft_token_ids=draft_token_ids, speculative=speculative)
        # A request with logits processors compiles its grammar as it is made (milliseconds; the first one also
        # builds the vocabulary's tables, 0.4 s): off the event loop. Others are made in place, where a thread hop
        # would cost more than the work.
        req = await asyncio.to_thread(make) if params.processor_args() else make()
        sub = _Submission(req, sink)
        self._inbox.put(sub)
        self._wake.set()
        if self._ended is not None:  # as in run_on_engine
            self._fail_queued_jobs(self._ended)
        finished = False
        try:
            # Re-raises the engine's validation error. Cancelled here, the submission is either dropped before the
            # engine takes it or, if already taken, aborted by the _Abort queued behind it.
            await asyncio.wrap_future(sub.accepted)
            while True:
                item = await outputs.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            if not finished:
                self._inbox.put(_Abort(sub))
                self._wake.set()

    async def cancel(self, req_id: str) -> bool:
        """End a running request now, finished with finish_reason "abort": unlike leaving its stream (which aborts
        it unseen), its stream gets that last output and ends as any finished request does. Returns whether it was
        still running."""
        return bool(await self.run_on_engine(functools.partial(self._cancel, req_id)))

    def _cancel(self, req_id: str, core: EngineCore) -> bool:
        out = core.abort(req_id)
        if out is None:  # finished already: its last output went to its stream
            return False
        self._observe("on_abort", core, out)
        sink = self._sinks.pop(req_id, None)
        if sink is not None:
            self._deliver(req_id, sink, out)
        return True

    async def embed(self, inputs: Sequence[Prompt], param: str = "input") -> list[list[float]]:
        """Each input's embedding, one group of inputs (a step's token budget) between two engine steps; cancelling
        the call drops the groups not yet run.

        :param param: the request field the inputs came in, named in errors."""
        token_lists = [self.inputs.encode(x, param) for x in inputs]
        self.inputs.check_embedding_inputs(token_lists, param)
        vectors: list[list[float]] = []
        for group in token_groups(token_lists, self.core.config.scheduling.max_num_batched_tokens):
            vectors += await self.run_on_engine(operator.methodcaller("embed", group), heavy=True)
        return vectors

    async def prompt_logprobs(self, token_lists: Sequence[list[int]], num_top: int) -> list[list[TokenLogprob | None]]:
        """EngineCore.prompt_logprobs on the engine thread, a group of prompts between two steps (as :meth:`embed`)."""
        scored: list[list[TokenLogprob | None]] = []
        for group in scoring_groups(token_lists):
            scored += await self.run_on_engine(operator.methodcaller("prompt_logprobs", group, num_top), heavy=True)
        return scored

    async def run_on_engine(self, fn: Callable[[EngineCore], Any], heavy: bool = False) -> Any:
        """Run ``fn(core)`` on the engine thread between two steps and return its result.

        :param heavy: ``fn`` is a forward pass of its own: while requests run, one such job runs between two steps.
        """
        job = _Job(fn, heavy=heavy)
        self._inbox.put(job)
        self._wake.set()
        if self._ended is not None:
            # The loop has ended: it set this before emptying the inbox, so a job put before this test is ended
            # there and one put after it here.
            self._fail_queued_jobs(self._ended)
        return await asyncio.wrap_future(job.done)

    # -- the engine thread ----------------------------------------------------------------------------------------

    def _run(self) -> None:
        failed = EngineFailed("the engine has stopped")
        try:
            while not self._stopping.is_set():
                self._drain_inbox()
                self._run_heavy_job()
                if not self.core.has_unfinished_requests():
                    if self._heavy:
                        continue  # the next one at once: no step waits for it
                    self.core.note_idle()
                    self._wake.wait(0.05)
                    self._wake.clear()
                    if time.monotonic() - self._last_tick >= IDLE_TICK_S:
                        self._last_tick = time.monotonic()
                        self.core.maintain()
                        self._observe("on_idle", self.core)
                    continue
                start = time.monotonic()
                outputs = self.core.step()
                if self.core.hold_s > 0 and not outputs:
                    # The scheduler is merging arrivals: sleep until its window closes or a request comes in.
                    self._wake.wait(self.core.hold_s)
                    self._wake.clear()
                    self._observe("on_hold", time.monotonic() - start)
                    continue
                self.num_steps += 1
                self.last_step_time = time.monotonic()
                # Observers first, so metrics already count a request when its stream sees the final output.
                self._observe("on_step", self.core, outputs, self.last_step_time - start)
                for out in outputs:
                    sink = self._sinks.pop(out.req_id, None) if out.finished else self._sinks.get(out.req_id)
                    if sink is not None:
                        self._deliver(out.req_id, sink, out if out.error is None else _request_error(out.error))
        except BaseException as exc:  # the loop must never die silently: fail every waiting stream
            self.error = exc
            log.exception("engine loop failed")
            # An RtxError says what failed in words of its own; anything else is named by its type.
            failed = EngineFailed(f"engine failed: {str(exc) if isinstance(exc, RtxError) else repr(exc)}")
            for req_id, sink in list(self._sinks.items()):
                self._deliver(req_id, sink, failed)
            self._sinks.clear()
            raise
        finally:
            # Stopped or failed: nothing will run the jobs still queued, and their callers wait for them.
            self._ended = failed
            for job in self._heavy:
                if job.done.set_running_or_notify_cancel():
                    job.done.set_exception(failed)
            self._heavy.clear()
            self._fail_queued_jobs(failed)

    def _fail_queued_jobs(self, error: EngineFailed) -> None:
        """End the jobs and submissions in the inbox with ``error`` (after the loop ended; from either thread: each
        is taken once)."""
        while True:
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return
            if isinstance(item, _Job) and item.done.set_running_or_notify_cancel():
                item.done.set_exception(error)
            elif isinstance(item, _Submission) and item.accepted.set_running_or_notify_cancel():
                item.accepted.set_exception(error)

    def _deliver(self, req_id: str, sink: Callable, item: RequestOutput | BaseException) -> None:
        try:
            sink(item)
        except RuntimeError:
            # The stream's event loop is gone: nobody will read this request any more.
            if self.error is None:
                self._abort_stream(req_id, sink)

    def _abort_stream(self, req_id: str, sink: Callable) -> None:
        """Abort ``req_id`` if ``sink``'s stream still holds it (not a later request that reused the id)."""
        if self._sinks.get(req_id) is not sink:
            return
        del self._sinks[req_id]
        out = self.core.abort(req_id)
        if out is not None:
            self._observe("on_abort", self.core, out)

    def _observe(self, hook: str, *args: object) -> None:
        # A broken metrics hook must cost a log line, not the engine loop and every stream on it.
        for observer in self.observers:
            fn = getattr(observer, hook, None)
            if fn is None:
                continue
            try:
                fn(*args)
            except Exception:
                log.exception("step observer %s failed", hook)

    def _run_heavy_job(self) -> None:
        """The oldest heavy job whose caller still waits for it, if any."""
        while self._heavy:
            job = self._heavy.popleft()
            if not job.done.cancelled():
                # The last step's time ends here: the pass is not part of the step that follows it.
                self.core.note_idle()
                self._run_job(job)
                return

    def _run_job(self, job: _Job) -> None:
        # A future its caller stopped waiting for is cancelled: set_result on it would raise here, on the engine
        # thread, and stop the engine for every request. set_running_or_notify_cancel() settles the race.
        if not job.done.set_running_or_notify_cancel():
            return
        try:
            job.done.set_result(job.fn(self.core))
        except BaseException as exc:
            job.done.set_exception(exc)

    def _drain_inbox(self) -> None:
        while True:
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return
            # A future its caller stopped waiting for is cancelled: set_result on it would raise here, on the engine
            # thread, and stop the engine for every request. set_running_or_notify_cancel() settles the race.
            if isinstance(item, _Job):
                if item.heavy:
                    self._heavy.append(item)
                else:
                    self._run_job(item)
                continue
            if isinstance(item, _Abort):
                self._abort_stream(item.sub.req.req_id, item.sub.sink)
                continue
            if not item.accepted.set_running_or_notify_cancel():
                continue
            try:
                self.core.add_request(item.req)
            except BaseException as exc:
                item.accepted.set_exception(exc)
                continue
            self._sinks[item.req.req_id] = item.sink
            item.accepted.set_result(item.req.req_id)
            self._observe("on_admit", item.req, item.submitted_at, time.monotonic())


def _request_error(failure: RequestFailure) -> RequestError:
    """The error a failed request's client gets: its own (400) when its arguments could not go on, else the
    plugin's (500)."""
    if failure.param is not None:
        return InvalidRequestError(failure.describe(), param=failure.param)
    return RequestError(ErrorCode.INTERNAL, failure.describe(), reason="plugin_failed")
