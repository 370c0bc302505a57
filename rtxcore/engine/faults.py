"""Faults that stay small: an exception inside a step fails the requests it can be pinned on, not the engine.

A plugin that raises for one request (a third-party sampler on one row's parameters, a grammar on one request's
state, a proposer, the detokenizer on an odd token) would otherwise end the engine loop and every request on it.
Here the batched call is tried once as usual; only when it raises is each request tried alone, on logits computed
again (processors and samplers may have changed the first ones in place; the step's forward pass is run once more,
rewriting the same KV, which costs nothing on the happy path, unlike a copy of every step's logits) and with its
generator rewound, to find the ones that fail. Those end with an error naming the plugin
(``finish_reason`` "error"); the others are sampled together again, so they get the tokens they would have got.

A backend step that raises cannot be pinned on a request: it is retried once after the backend has freed what it
can (:meth:`ExecutionBackend.recover`); a second failure fails the step's requests, and only a failure in two steps
in a row gives up on the engine (:class:`EngineFailed`, which marks it unhealthy).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING

import torch

from rtxcore.contracts.sampler import SamplerOutput, SamplingBatch
from rtxcore.engine.batch_builder import StepPlan
from rtxcore.engine.outputs import NO_TOKEN, RequestFailure
from rtxcore.errors import EngineFailed
from rtxcore.request import Request

if TYPE_CHECKING:
    from rtxcore.engine.core import EngineCore

log = logging.getLogger(__name__)


class PluginFault(Exception):
    """A plugin raised; carries which one, so that the request's error names it."""

    def __init__(self, cause: str, plugin: str, exc: BaseException, param: str | None = None):
        """:param param: the request field at fault, when the request's arguments are (then the message is the
            exception's own, for the client)."""
        super().__init__(str(exc) if param is not None else f"{type(exc).__name__}: {exc}")
        self.cause = cause
        self.plugin = plugin
        self.param = param

    def failure(self) -> RequestFailure:
        return RequestFailure(self.cause, self.plugin, str(self), self.param)


def fault_of(exc: Exception, cause: str, plugin: str) -> RequestFailure:
    """The failure an exception stands for: a :class:`PluginFault` names its plugin, anything else ``plugin``."""
    if isinstance(exc, PluginFault):
        return exc.failure()
    return RequestFailure(cause, plugin, f"{type(exc).__name__}: {exc}")


class StepFaults:
    """The engine's guarded calls; one per engine."""

    # Steps in a row whose backend call failed twice: then the engine is beyond repair.
    MAX_FAILED_STEPS = 2

    def __init__(self, core: EngineCore):
        self.core = core
        self._failed_steps = 0
        # Backend calls that ran out of device memory (torch.OutOfMemoryError), retried or not: rtx_oom_total.
        self.num_out_of_memory = 0

    # -- the backend ----------------------------------------------------------------------------------------------

    def execute(self, plan: StepPlan) -> torch.Tensor | None:
        """The step's logits, or None when the backend failed twice on it (its requests have failed)."""
        core = self.core
        for attempt in (1, 2):
            try:
                logits = core.execute(plan)
            except EngineFailed:
                raise  # the backend knows nothing here will step again (a parallel rank is gone)
            except Exception as exc:
                if isinstance(exc, torch.OutOfMemoryError):
                    self.num_out_of_memory += 1
                if attempt == 1:
                    log.error("backend %r failed a step of %d requests (%s: %s); retrying it once",
                              core.config.backend, len(plan.reqs), type(exc).__name__, exc)
                    core.backend.recover()
                    continue
                self._failed_steps += 1
                if self._failed_steps >= self.MAX_FAILED_STEPS:
                    raise EngineFailed(f"backend {core.config.backend!r} failed {self._failed_steps} steps in a row: "
                                       f"{type(exc).__name__}: {exc}") from exc
                failure = fault_of(exc, "backend", core.config.backend)
                for req in plan.reqs:
                    core.fail(req, failure)
                return None
            self._failed_steps = 0
            return logits
        raise AssertionError("unreachable: the second attempt returns or raises")

    # -- logits processors and the sampler --------------------------------------------------------------------------

    def sample(self, logits: torch.Tensor, plan: StepPlan, reqs: list[Request], num_rows: list[int] | None,
               batch: SamplingBatch) -> tuple[list[Request], list[int] | None, SamplerOutput | None]:
        """Apply the logits processors and sample the step's ``reqs`` (``plan``'s), failing the requests on which
        either raises.

        :returns: the requests that sampled, their rows per request (as ``num_rows``), and their samples (None
            when none is left).
        """
        core = self.core
        # Seeded rows' generators, to rewind for a retry; read only when some request is seeded (rare), so the
        # usual step pays one dict test here.
        rewind = _generator_states(batch.generators) if core.generators else _nothing
        try:
            return reqs, num_rows, self._sample(logits, reqs, num_rows, batch)
        except Exception:
            pass  # find out which requests it fails on
        try:
            backup = core.backend.execute(plan.batch)  # the logits as they were before anything changed them
        except Exception as exc:
            for req in reqs:
                core.fail(req, fault_of(exc, "backend", core.config.backend))
            return [], None, None
        spans = _row_spans(reqs, num_rows)
        kept: list[int] = []
        for i, req in enumerate(reqs):
            rows = spans[i]
            rewind()
            try:
                self._sample(backup[rows], [req], _rows_of([i], num_rows), _select(batch, rows))
            except Exception as exc:
                core.fail(req, fault_of(exc, "sampler", core.config.sampler))
            else:
                kept.append(i)
        rewind()
        if not kept:
            return [], None, None
        rows = [row for i in kept for row in spans[i]]
        kept_reqs = [reqs[i] for i in kept]
        kept_num_rows = _rows_of(kept, num_rows)
        try:
            return kept_reqs, kept_num_rows, self._sample(backup[rows], kept_reqs, kept_num_rows,
                                                          _select(batch, rows))
        except Exception as exc:  # fails together but not alone: nothing to pin it on
            for req in kept_reqs:
                core.fail(req, fault_of(exc, "sampler", core.config.sampler))
            return [], None, None

    def _sample(self, logits: torch.Tensor, reqs: list[Request], num_rows: list[int] | None,
                batch: SamplingBatch) -> SamplerOutput:
        core = self.core
        core.logits.apply(logits, reqs, num_rows)
        try:
            sampled = core.sampler.sample(logits, batch)
        except Exception as exc:
            raise PluginFault("sampler", core.config.sampler, exc) from exc
        if core.logits.active:
            # A processor may leave a row nothing to sample; the sampler then draws from -inf or NaN. Marked on the
            # device (no sync): the host fails the request when it reads NO_TOKEN (OutputProcessor.apply).
            nothing_left = ~(logits > float("-inf")).any(dim=-1)
            sampled.token_ids = sampled.token_ids.masked_fill(nothing_left, NO_TOKEN)
        return sampled

    # -- per-request work after a step ------------------------------------------------------------------------------

    def each(self, reqs: Sequence[Request], cause: str, plugin: str, fn: Callable[[list[Request]], None]) -> None:
        """Call ``fn`` on ``reqs`` together; if it raises, on each request alone, failing those it raises on."""
        try:
            fn(list(reqs))
            return
        except Exception:
            pass
        for req in reqs:
            if req.status.finished:
                continue
            try:
                fn([req])
            except Exception as exc:
                self.core.fail(req, fault_of(exc, cause, plugin))


def _row_spans(reqs: list[Request], num_rows: list[int] | None) -> list[list[int]]:
    if num_rows is None:
        return [[i] for i in range(len(reqs))]
    spans, start = [], 0
    for n in num_rows:
        spans.append(list(range(start, start + n)))
        start += n
    return spans


def _rows_of(kept: list[int], num_rows: list[int] | None) -> list[int] | None:
    return None if num_rows is None else [num_rows[i] for i in kept]


def _select(batch: SamplingBatch, rows: list[int]) -> SamplingBatch:
    return replace(batch, params=[batch.params[r] for r in rows],
                   prompt_token_ids=[batch.prompt_token_ids[r] for r in rows],
                   output_token_ids=[batch.output_token_ids[r] for r in rows],
                   generators=[batch.generators[r] for r in rows])


def _nothing() -> None:
    pass


def _generator_states(generators: list[torch.Generator | None]) -> Callable[[], None]:
    """A function that puts every seeded row's generator back where it is now (a seeded request draws the same
    tokens when retried). Seeded rows are rare, and a state is a few bytes on the GPU (Philox seed and offset)."""
    seeded = {id(g): g for g in generators if g is not None}
    states = [(g, g.get_state()) for g in seeded.values()]

    def rewind() -> None:
        for g, state in states:
            g.set_state(state)
    return rewind
