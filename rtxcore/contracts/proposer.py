"""Proposer contract: guess the tokens that follow a running request's sequence, for the target model to verify.

Speculative decoding runs in two halves. After a step, the engine asks the proposer for up to ``k`` tokens per
request; the next step computes each request's last token and its proposed tokens together (one target pass), and
the engine keeps the longest run of proposals the target agrees with, plus the target's own next token. Greedy
requests therefore get exactly the tokens they would get without speculation, and sampled ones are drawn from the
target's distribution (each proposed token is accepted with the target's probability of it: rejection sampling with
a point-mass proposal), so a proposer can only change speed, never output.

A proposer sees only known tokens (``Request.all_token_ids``); the request's last token has no KV entry yet.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np

from rtxcore.request import Request

if TYPE_CHECKING:
    from rtxcore.contracts.backend import ExecutionBackend
    from rtxcore.registry import PluginRegistry


@dataclass(slots=True)
class ProposerContext:
    # The target model's backend, loaded, its KV cache allocated: what a self-speculative proposer runs.
    backend: ExecutionBackend
    # Tokens per KV block of the target's cache.
    block_size: int
    # The target's KV blocks (a proposer with a cache of its own sizes it for as many tokens).
    num_kv_blocks: int
    max_model_len: int
    registry: PluginRegistry
    # The target's block tables for requests by id (int32 [n, most blocks], padded with 0): what a proposer writing
    # the target's KV cache addresses it with.
    block_table_of: Callable[[list[str]], np.ndarray]
    # Builds and loads another model with the target's backend, device and dtype (a draft model), by the names
    # ``--model`` takes; None where the engine cannot (then a draft proposer reports it).
    load_model: Callable[[str], ExecutionBackend] | None = None
    # The proposer's own settings (``--speculative-option key=value``, the config file's ``[speculative.options]``):
    # only those its describe() lists under "options" (any other is refused before it is built).
    options: dict[str, Any] = field(default_factory=dict)


class Proposer(ABC):
    """Built as ``cls(context)``; one instance per engine. Called on the engine's thread, between steps."""

    # True for a proposer that writes the target's KV cache at the proposed positions (a self-speculative one
    # running the target's own layers): the engine then makes room for them in the target's cache before asking.
    writes_target_kv: ClassVar[bool] = False

    def __init__(self, context: ProposerContext):
        self.context = context

    @classmethod
    def describe(cls) -> dict[str, Any]:
        """What ``rtx plugins list`` shows; list the option names under ``"options"``."""
        return {}

    @abstractmethod
    def propose(self, reqs: Sequence[Request], num_tokens: Sequence[int]) -> list[list[int]]:
        """For each request, at most ``num_tokens[i]`` (>= 1) token ids guessed to follow its ``all_token_ids``;
        an empty list proposes nothing. Ids outside the vocabulary end a proposal where they appear."""

    def confidences(self, req: Request) -> list[float] | None:
        """The proposer's own probability of each token of its latest proposal for ``req``, or None when it has
        none. A proposer that gives them supports early exit: a request with ``early_exit_threshold`` keeps a
        proposed token whose probability reaches the threshold even where the target would have chosen another."""
        return None

    def finish(self, req: Request) -> None:
        """Forget whatever is kept for ``req``: it finished, was aborted, or stopped speculating."""
