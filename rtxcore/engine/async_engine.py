"""Drive an :class:`LLMEngine` from asyncio: one thread steps the engine, coroutines stream each request's outputs.

The engine is not thread-safe, so every call into it (add, abort, step) happens on the engine thread. Submissions
and aborts are queued and applied between steps: an abort frees the request's KV blocks before the next step runs.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import AsyncIterator, Callable

from rtxcore.engine.llm_engine import LLMEngine, Prompt
from rtxcore.engine.outputs import RequestOutput
from rtxcore.errors import RtxError
from rtxcore.sampling_params import SamplingParams


@dataclass(slots=True)
class _Submission:
    req_id: str
    prompt: Prompt
    params: SamplingParams
    cache_salt: str | None
    sink: Callable[[RequestOutput | BaseException], None]
    accepted: concurrent.futures.Future = field(default_factory=concurrent.futures.Future)


@dataclass(slots=True)
class _Job:
    # Work that needs the engine between steps (embeddings, inspection); its result or exception goes to ``done``.
    fn: Callable[[LLMEngine], object]
    done: concurrent.futures.Future = field(default_factory=concurrent.futures.Future)


@dataclass(slots=True)
class StepObserver:
    """Called on the engine thread after each step (metrics hook)."""

    on_step: Callable[[LLMEngine, list[RequestOutput], float], None]


class AsyncEngine:
    def __init__(self, engine: LLMEngine, observers: list[StepObserver] | None = None):
        self.engine = engine
        self.observers = observers or []
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._sinks: dict[str, Callable[[RequestOutput | BaseException], None]] = {}
        self._ids = itertools.count()
        self._wake = threading.Event()
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rtx-engine", daemon=True)
        self.last_step_time = 0.0
        self.error: BaseException | None = None
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
                       cache_salt: str | None = None) -> AsyncIterator[RequestOutput]:
        """Stream a request's outputs. Validation errors raise before the first output; leaving the iterator early
        (client gone, cancellation) aborts the request."""
        loop = asyncio.get_running_loop()
        outputs: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        req_id = req_id or f"req-{next(self._ids)}"

        def sink(item: RequestOutput | BaseException) -> None:
            loop.call_soon_threadsafe(outputs.put_nowait, item)

        sub = _Submission(req_id, prompt, params, cache_salt, sink)
        self._inbox.put(sub)
        self._wake.set()
        await asyncio.wrap_future(sub.accepted)  # re-raises the engine's validation error
        finished = False
        try:
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
                self.abort(req_id)

    async def embed(self, inputs: list[Prompt]) -> list[list[float]]:
        return await self.run_on_engine(lambda engine: engine.embed(inputs))

    async def run_on_engine(self, fn: Callable[[LLMEngine], object]):
        """Run ``fn(engine)`` on the engine thread between two steps and return its result."""
        job = _Job(fn)
        self._inbox.put(job)
        self._wake.set()
        return await asyncio.wrap_future(job.done)

    def abort(self, req_id: str) -> None:
        self._inbox.put(req_id)
        self._wake.set()

    # -- the engine thread ----------------------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while not self._stopping.is_set():
                self._drain_inbox()
                if not self.engine.has_unfinished_requests():
                    self._wake.wait(0.05)
                    self._wake.clear()
                    continue
                start = time.monotonic()
                outputs = self.engine.step()
                self.num_steps += 1
                self.last_step_time = time.monotonic()
                for out in outputs:
                    sink = self._sinks.get(out.req_id)
                    if out.finished:
                        self._sinks.pop(out.req_id, None)
                    if sink is not None:
                        sink(out)
                for observer in self.observers:
                    observer.on_step(self.engine, outputs, self.last_step_time - start)
        except BaseException as exc:  # the loop must never die silently: fail every waiting stream
            self.error = exc
            for sink in self._sinks.values():
                sink(RtxError(f"engine failed: {exc!r}"))
            self._sinks.clear()
            raise

    def _drain_inbox(self) -> None:
        while True:
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return
            if isinstance(item, _Job):
                try:
                    item.done.set_result(item.fn(self.engine))
                except BaseException as exc:
                    item.done.set_exception(exc)
                continue
            if isinstance(item, str):
                if self._sinks.pop(item, None) is not None:
                    out = self.engine.abort(item)
                    for observer in self.observers:
                        observer.on_step(self.engine, [out] if out else [], 0.0)
                continue
            try:
                self.engine.add_request(item.prompt, item.params, req_id=item.req_id, cache_salt=item.cache_salt)
            except BaseException as exc:
                item.accepted.set_exception(exc)
                continue
            self._sinks[item.req_id] = item.sink
            item.accepted.set_result(item.req_id)
