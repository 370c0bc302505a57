"""The engine's logits processors (:mod:`rtxcore.contracts.logits_processor`): arguments prepared when a request is
made, a state per request while it runs, and one batched call per processor between the forward pass and the
sampler. A step in which no request uses a processor costs one integer test."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import torch

from rtxcore.contracts.logits_processor import (
    LogitsProcessor,
    LogitsProcessorContext,
    RequestArgumentError,
    RowContext,
)
from rtxcore.engine.faults import PluginFault
from rtxcore.errors import ConfigError, InvalidRequestError
from rtxcore.request import Request
from rtxcore.sampling_params import PROCESSOR_FIELDS, SamplingParams

if TYPE_CHECKING:
    from rtxcore.registry import PluginRegistry



@dataclass(slots=True, eq=False)
class RequestLogits:
    """A request's processors: prepared arguments by processor name, then (in the engine) their states."""

    prepared: dict[str, Any]
    states: dict[str, Any] = field(default_factory=dict)
    # Output tokens the states have seen.
    seen: int = 0
    # Some processor needs every sampled token before the next row (the overlapped step leaves the request alone).
    stateful: bool = False
    # The processors that may force tokens (they override forced_tokens), asked in this order.
    forcing: tuple[str, ...] = ()


def check_processor_options(registry: PluginRegistry, options: Mapping[str, Mapping[str, Any]]) -> None:
    """:raises ConfigError: options for a processor that is not installed, or an option a processor does not list in
        its describe()'s ``"options"`` (so a processor reads only settings it declared)."""
    names = registry.names("logits_processor")
    unknown = sorted(set(options) - set(names))
    if unknown:
        raise ConfigError(f"logits processor options for {unknown[0]!r}: no logits processor of that name is "
                          f"installed (installed: {', '.join(names) or 'none'})")
    for name, given in options.items():
        cls: type[LogitsProcessor] = registry.get("logits_processor", name).cls
        accepted = list(cls.describe().get("options", []))
        extra = sorted(set(given) - set(accepted))
        if extra:
            raise ConfigError(f"unknown {name} option {extra[0]!r} (options: {', '.join(accepted) or 'none'})")


def build_processors(registry: PluginRegistry, context: LogitsProcessorContext,
                     options: Mapping[str, Mapping[str, Any]]) -> dict[str, LogitsProcessor]:
    """Every installed logits processor, each with its own ``options`` in its context (checked first)."""
    check_processor_options(registry, options)
    return {name: registry.create("logits_processor", name, replace(context, options=dict(options.get(name, {}))))
            for name in registry.names("logits_processor")}


def _prepare(processor: LogitsProcessor, value: Any, param: str) -> Any:
    """``processor.prepare(value)``, its ValueError a request error naming ``param``."""
    try:
        return processor.prepare(value)
    except ValueError as exc:
        raise InvalidRequestError(f"{param}: {exc}", param=param) from None


def _fault(name: str, exc: Exception) -> PluginFault:
    """Processor ``name`` raised ``exc``: its fault, or the request's when its arguments cannot go on."""
    param = PROCESSOR_FIELDS.get(name, "logits_processors") if isinstance(exc, RequestArgumentError) else None
    return PluginFault("logits_processor", name, exc, param)


class LogitsProcessing:
    def __init__(self, processors: dict[str, LogitsProcessor]):
        self.processors = processors
        # Requests in the engine with processors; steps skip everything while it is empty.
        self._num_active = 0

    def prepare(self, params: SamplingParams) -> RequestLogits | None:
        """Check a request's processor arguments and prepare them (any thread); None when it uses no processor.

        :raises InvalidRequestError: naming the request field, with the processor's message.
        """
        args = params.processor_args()
        if not args:
            return None
        prepared: dict[str, Any] = {}
        for name, value in args.items():
            param = PROCESSOR_FIELDS.get(name, "logits_processors")
            processor = self.processors.get(name)
            if processor is None:
                raise InvalidRequestError(f"no logits processor named {name!r} is installed (installed: "
                                          f"{', '.join(sorted(self.processors)) or 'none'})", param=param)
            prepared[name] = _prepare(processor, value, param)
        return RequestLogits(prepared)

    def check(self, name: str, value: Any, param: str) -> None:
        """Prepare ``value`` as processor ``name``'s argument the way a request's is (processors keep what they
        prepared), refusing what a request would be refused; nothing when no such processor is installed.

        :raises InvalidRequestError: naming ``param``, with the processor's message.
        """
        processor = self.processors.get(name)
        if processor is not None:
            _prepare(processor, value, param)

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
        logits.forcing = tuple(name for name in logits.states
                               if type(self.processors[name]).forced_tokens is not LogitsProcessor.forced_tokens)
        self._num_active += 1

    def on_finish(self, req: Request) -> None:
        logits = req.logits
        if logits is None or not logits.states:
            return
        for name, state in logits.states.items():
            self.processors[name].finish(state)
        logits.states = {}
        self._num_active -= 1

    @property
    def active(self) -> bool:
        """Whether a request in the engine uses a processor."""
        return self._num_active > 0

    def apply(self, logits: torch.Tensor, reqs: Sequence[Request], rows_of: Sequence[int] | None) -> None:
        """Change the step's logits in place before sampling.

        :param reqs: the step's sampling requests, in row order.
        :param rows_of: rows per request when some verify proposed tokens (speculative decoding), else None.
        """
        if not self._num_active:
            return
        rows: dict[str, list[RowContext]] = defaultdict(list)
        row = 0
        for i, req in enumerate(reqs):
            num_rows = rows_of[i] if rows_of is not None else 1
            state = req.logits
            if state is not None and state.states:
                self._catch_up(req, state)
                generated = state.seen + req.num_pending_tokens
                for j in range(num_rows):
                    proposed = req.spec_token_ids[:j] if j else ()
                    for name, processor_state in state.states.items():
                        rows[name].append(RowContext(row + j, processor_state, proposed, generated + j))
            row += num_rows
        # In the order requests name them, those that read what the others left after them (a stable sort).
        for name, processor_rows in sorted(rows.items(), key=lambda item: self.processors[item[0]].applies_last):
            try:
                self.processors[name].apply(logits, processor_rows)
            except Exception as exc:
                raise _fault(name, exc) from exc

    def forced_tokens(self, req: Request, max_tokens: int) -> list[int]:
        """At most ``max_tokens`` tokens that ``req``'s processors force next (the first processor that forces any),
        having seen every token it generated; empty when none does."""
        state = req.logits
        if state is None or not state.forcing or not state.states:
            return []
        self._catch_up(req, state)
        for name in state.forcing:
            try:
                tokens = self.processors[name].forced_tokens(state.states[name], max_tokens)
            except Exception as exc:
                raise _fault(name, exc) from exc
            if tokens:
                return list(tokens[:max_tokens])
        return []

    def _catch_up(self, req: Request, state: RequestLogits) -> None:
        outputs = req.output_token_ids
        if len(outputs) > state.seen:
            new = outputs[state.seen:]
            for name, processor_state in state.states.items():
                try:
                    self.processors[name].advance(processor_state, new)
                except Exception as exc:
                    raise _fault(name, exc) from exc
            state.seen = len(outputs)
