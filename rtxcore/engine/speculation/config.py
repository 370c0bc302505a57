"""Speculative-decoding settings (``--speculative``, the config file's ``[speculative]`` table)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from rtxcore.errors import ConfigError


@dataclass(slots=True)
class SpeculativeConfig:
    # Proposer plugin for every request (ngram, draft, layer-skip, or a third party's); None: only requests that
    # bring their own tokens (``prediction``, ``draft_token_ids``) speculate.
    method: str | None = None
    # Most tokens proposed per request per step.
    num_speculative_tokens: int = 4
    # The proposer's own settings (for example draft_model for draft, layers for layer-skip).
    options: dict[str, Any] = field(default_factory=dict)
    # Adapt each request's number of proposed tokens to what it gets accepted (off: always num_speculative_tokens).
    adaptive: bool = True
    # A request whose smoothed acceptance rate falls below this decodes plainly for a while (fallback).
    min_acceptance: float = 0.1
    # With at least this many requests running, none speculates: a large batch keeps the device busy without it.
    # None: no limit.
    disable_batch_size: int | None = 32
    # Propose the tokens a request's grammar forces (structured output: keys, quotes, brackets), verified like any
    # proposal, whatever the method. None: where steps run one after another anyway (on a CPU, or with a method);
    # not yet where steps overlap (a GPU without a method), as proposing needs each step's tokens on the host.
    grammar_proposals: bool | None = None

    def __post_init__(self) -> None:
        if not 1 <= self.num_speculative_tokens <= 16:
            raise ConfigError(f"num_speculative_tokens must be in [1, 16], got {self.num_speculative_tokens}")
        if not 0 <= self.min_acceptance < 1:
            raise ConfigError(f"min_acceptance must be in [0, 1), got {self.min_acceptance}")
        if self.disable_batch_size is not None and self.disable_batch_size < 1:
            raise ConfigError(f"disable_batch_size must be >= 1, got {self.disable_batch_size}")
