"""The engine's logits processors (:mod:`rtxcore.contracts.logits_processor`): arguments prepared when a request is
made, a state per request while it runs, and one batched call per processor between the forward pass and the
sampler. A step in which no request uses a processor costs one integer test."""

from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

from rtxcore.contracts.logits_processor import LogitsProcessor, RowContext
from rtxcore.engine.faults import PluginFault
from rtxcore.engine.in_flight import InFlightStep
from rtxcore.errors import InvalidRequestError
from rtxcore.request import Request
from rtxcore.sampling_params import SamplingParams

log = logging.getLogger(__name__)

# The request field behind each built-in processor, named in errors; other processors come from logits_processors.
_PARAM_OF = {"logit_bias": "logit_bias", "allowed_tokens": "allowed_token_ids", "banned_tokens": "banned_token_ids",
             "structured_output": "structured_output"}


@dataclass(slots=True, eq=False)
class RequestLogits:
    """A request's processors: prepared arguments by processor name, then (in the engine) their states."""

    prepared: dict[str, Any]
    states: dict[str, Any] = field(default_factory=dict)
    # Output tokens the states have seen.
    seen: int = 0
    # Some processor needs every sampled token before the next row (the overlapped step leaves the request alone).
    stateful: bool = False


class LogitsProcessing:
    def __init__(self, processors: dict[str, LogitsProcessor]):
        self.processors = processors
        # Requests in the engine with processors; steps skip everything while it is empty.
        self._num_active = 0
        # The overlapped step's early thread (see start_early), its job, and the requests it failed on.
        self._early_thread: ThreadPoolExecutor | None = None
        self._early: Future | None = None
        self._failures: list[tuple[Request, PluginFault]] = []

    def prepare(self, params: SamplingParams) -> RequestLogits | None:
        """Check a request's processor arguments and prepare them (any thread); None when it uses no processor.

        :raises InvalidRequestError: naming the request field, with the processor's message.
        """
        args = params.processor_args()
        if not args:
            return None
        prepared: dict[str, Any] = {}
        for name, value in args.items():
            param = _PARAM_OF.get(name, "logits_processors")
            processor = self.processors.get(name)
            if processor is None:
                raise InvalidRequestError(f"no logits processor named {name!r} is installed (installed: "
                                          f"{', '.join(sorted(self.processors)) or 'none'})", param=param)
            try:
                prepared[name] = processor.prepare(value)
            except ValueError as exc:
                raise InvalidRequestError(f"{param}: {exc}", param=param) from None
        return RequestLogits(prepared)

    def on_add(self, req: Request) -> None:
        """Build the request's states, having seen the tokens it already generated (a resumed request)."""
        logits = req.logits
        if logits is None:
            return
        outputs = req.output_token_ids
        logits.states = {name: self.processors[name].new_state(prepared, outputs)
                         for name, prepared in logits.prepared.items()}
        logits.seen = len(outputs)
        logits.stateful = any(self.processors[name].stateful for name in logits.states)
        self._num_active += 1

    def on_finish(self, req: Request) -> None:
        logits = req.logits
        if logits is None or not logits.states:
            return
        self._join()
        for name, state in logits.states.items():
            self.processors[name].finish(state)
        logits.states = {}
        self._num_active -= 1

    def start_early(self, reqs: Sequence[Request], step: InFlightStep) -> None:
        """The overlapped step, right after launching a step whose tokens its requests' grammars will need: on the
        early thread, wait for those tokens, let each request's states see its token, and let processors prefetch
        the next rows' work (:meth:`LogitsProcessor.prefetch`), all while the engine's thread prepares the next
        step. The engine's thread touches no state before :meth:`take_failures` (or a method here) has joined it."""
        self._join()
        entries = []
        for row, req in enumerate(reqs):
            state = req.logits
            if state is not None and state.states:
                self._catch_up(req, state)  # here, on the engine's thread: it reads the request's tokens
                entries.append((row, req, state))
        if entries:
            if self._early_thread is None:
                self._early_thread = ThreadPoolExecutor(1, thread_name_prefix="rtx-logits-early")
            self._early = self._early_thread.submit(self._advance_early, entries, step)

    def _advance_early(self, entries: list[tuple[int, Request, RequestLogits]], step: InFlightStep) -> None:
        token_ids = step.wait().token_ids.tolist()
        ready: dict[str, list[Any]] = defaultdict(list)
        for row, req, state in entries:
            token = token_ids[row]
            try:
                for name, processor_state in state.states.items():
                    try:
                        self.processors[name].advance(processor_state, (token,))
                    except Exception as exc:
                        raise PluginFault("logits_processor", name, exc) from exc
            except PluginFault as fault:
                self._failures.append((req, fault))
                continue
            state.seen += 1  # the engine's thread appends the token to the request's outputs meanwhile
            for name, processor_state in state.states.items():
                ready[name].append(processor_state)
        for name, states in ready.items():
            try:
                self.processors[name].prefetch(states)
            except Exception:  # apply does the work itself, and pins a fault on the request it comes from
                log.exception("logits processor %r failed to prefetch", name)

    def _join(self) -> None:
        if self._early is not None:
            early, self._early = self._early, None
            early.result()

    def take_failures(self) -> list[tuple[Request, PluginFault]]:
        """Join the early thread; the requests a processor raised on there, for the engine to fail."""
        self._join()
        failures, self._failures = self._failures, []
        return failures

    def apply(self, logits: torch.Tensor, reqs: Sequence[Request], rows_of: Sequence[int] | None) -> None:
        """Change the step's logits in place before sampling.

        :param reqs: the step's sampling requests, in row order.
        :param rows_of: rows per request when some verify proposed tokens (speculative decoding), else None.
        """
        if not self._num_active:
            return
        self._join()
        rows: dict[str, list[RowContext]] = defaultdict(list)
        row = 0
        for i, req in enumerate(reqs):
            num_rows = rows_of[i] if rows_of is not None else 1
            state = req.logits
            if state is not None and state.states:
                self._catch_up(req, state)
                for j in range(num_rows):
                    proposed = req.spec_token_ids[:j] if j else ()
                    for name, processor_state in state.states.items():
                        rows[name].append(RowContext(row + j, processor_state, proposed))
            row += num_rows
        for name, processor_rows in rows.items():
            try:
                self.processors[name].apply(logits, processor_rows)
            except Exception as exc:
                raise PluginFault("logits_processor", name, exc) from exc

    def _catch_up(self, req: Request, state: RequestLogits) -> None:
        outputs = req.output_token_ids
        if len(outputs) > state.seen:
            new = outputs[state.seen:]
            for name, processor_state in state.states.items():
                try:
                    self.processors[name].advance(processor_state, new)
                except Exception as exc:
                    raise PluginFault("logits_processor", name, exc) from exc
            state.seen = len(outputs)
