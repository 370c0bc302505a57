"""Logits-processor contract: change a request's next-token scores before the sampler draws from them.

A request names the processors it wants and gives each its arguments (``SamplingParams.processor_args()``: the
built-in ``logit_bias``, ``allowed_tokens``, ``banned_tokens`` and ``structured_output`` from their own request
fields, any other plugin from ``logits_processors: {name: args}``). A processor's work is split by thread and cost:

1. :meth:`LogitsProcessor.prepare` checks the arguments and does the expensive, shareable work (compiling a
   grammar) on the thread that admits the request, never the engine's; a bad argument raises ``ValueError`` with a
   message for the caller (an HTTP 400 naming the field).
2. :meth:`LogitsProcessor.new_state` builds the request's own state (a grammar matcher) on the engine's thread, given
   the tokens the request has already generated (a request resumed after a restart rebuilds its state from them).
3. :meth:`LogitsProcessor.apply` changes the logits rows of every request using the processor, in one batched call
   per step. Before it, each state has seen every generated token through :meth:`LogitsProcessor.advance`. Steps
   with no request using any processor never call anything here.

Speculative decoding verifies proposed tokens: a request then has several rows, the row after ``j`` proposed tokens
scored as if they had been generated (``RowContext.proposed``). A stateful processor (a grammar) advances over them,
fills the row and rolls back. A processor whose state can leave a single way on (a grammar inside a key or a
punctuation run) says so through :meth:`LogitsProcessor.forced_tokens`: the engine proposes those tokens, and the
next step verifies them together instead of generating them one step each.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

import torch

if TYPE_CHECKING:
    from rtxcore.tokenizer import Tokenizer


class RequestArgumentError(ValueError):
    """Raised from :meth:`LogitsProcessor.advance`, :meth:`~LogitsProcessor.apply` or
    :meth:`~LogitsProcessor.forced_tokens` when the request's own arguments cannot go on, though ``prepare``
    accepted them (a grammar past the grammar engine's limits, met only as generation reaches that part of it): the
    request ends as its client's error (HTTP 400, gRPC INVALID_ARGUMENT) naming its field, not as the plugin's fault.
    Any other exception is the plugin's fault (HTTP 500)."""


@dataclass(slots=True)
class LogitsProcessorContext:
    # The model's tokenizer (None for a model without one: text-based processors then refuse in prepare).
    tokenizer: Tokenizer | None
    # Width of a logits row; may exceed the tokenizer's vocabulary (padded embeddings).
    vocab_size: int
    # Tokens that end a sequence: what a grammar allows once it is complete.
    eos_token_ids: list[int]
    # Where the logits live.
    device: torch.device
    # The processor's own settings (``--logits-processor-option NAME.KEY=VALUE``, the config file's
    # ``[logits_processors.NAME]``): only those its describe() lists under "options"; empty by default.
    options: dict[str, Any] = field(default_factory=dict)


@dataclass(slots=True)
class RowContext:
    """One logits row of a step: whose it is and what comes before it."""

    # Index of the row in the step's logits.
    row: int
    # The request's state from new_state.
    state: Any
    # Proposed tokens (speculative decoding) to treat as generated before this row; empty for an ordinary row.
    proposed: Sequence[int] = ()
    # Tokens the request generated before this row: those the state has seen, those sampled but not yet read by the
    # host (an overlapped step), and ``proposed``.
    num_generated: int = 0


class LogitsProcessor(ABC):
    """Built as ``cls(context)``, one instance per engine. ``prepare`` may run on any thread at once; the other
    methods run on the engine's thread, between or inside steps."""

    # True when a state must see each sampled token before the request's next row is processed (a grammar): such a
    # request's steps are not overlapped with reading their tokens.
    stateful: ClassVar[bool] = False
    # True for a processor that reads what the others left of a row (min_tokens keeps a row its ending tokens when
    # nothing else is left): it applies after every processor without it.
    applies_last: ClassVar[bool] = False

    def __init__(self, context: LogitsProcessorContext):
        self.context = context

    @classmethod
    def describe(cls) -> dict[str, Any]:
        """What ``rtx plugins list --verbose`` shows; ``"example_args"`` (required by ``rtx plugins test``) lists
        arguments a request may give, as ``prepare`` receives them; ``"options"`` names the settings the processor
        takes in ``context.options`` (any other is refused before it is built)."""
        return {}

    @abstractmethod
    def prepare(self, args: Any) -> Any:
        """Check a request's arguments and turn them into what :meth:`new_state` takes (compiled once, shareable).

        :raises ValueError: the arguments are wrong; the message is shown to the caller as it is.
        """

    @abstractmethod
    def new_state(self, prepared: Any, output_token_ids: Sequence[int]) -> Any:
        """A request's state, having seen ``output_token_ids`` (empty for a new request)."""

    @abstractmethod
    def apply(self, logits: torch.Tensor, rows: Sequence[RowContext]) -> None:
        """Change ``logits`` (float [num_rows, vocab_size], on the device) in place at the given rows, in as few
        device operations as the processor can."""

    def forced_tokens(self, state: Any, max_tokens: int) -> list[int]:
        """At most ``max_tokens`` tokens that the state lets through as the only way on from here (the tokens a
        grammar forces next); empty when the choice is open, the default. They are proposed like a speculative
        proposer's and verified by the target, so a wrong one costs a logits row, never output."""
        return []

    def advance(self, state: Any, token_ids: Sequence[int]) -> None:
        """Tokens the request generated since the state last saw one, in order. Stateless processors ignore them."""

    def finish(self, state: Any) -> None:
        """The request left the engine: release what the state holds."""
