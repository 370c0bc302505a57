"""Sampler contract: turn one row of logits per request into its next token.

A sampler does all of a row's :class:`SamplingParams` that shape the draw: penalties (repetition, presence,
frequency) first, then temperature (0 is greedy: the argmax of the penalized logits), top-k, top-p over what top-k
left, min-p, and the draw itself, from the row's own generator when it is seeded.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from rtxcore.sampling_params import SamplingParams


@dataclass(slots=True)
class SamplingBatch:
    # One entry per logits row, in row order.
    params: list[SamplingParams]
    # Prompt tokens per row (repetition penalty looks at them).
    prompt_token_ids: list[list[int]]
    # Tokens generated so far per row (penalties look at them).
    output_token_ids: list[list[int]]
    # Per-row generator for seeded requests (on the logits' device), None for unseeded. A row's generator advances
    # only when that row is sampled, and by the same amount every step, so the same seed gives the same tokens
    # whatever else is in the batch.
    generators: list[torch.Generator | None]

    def __len__(self) -> int:
        return len(self.params)

    @property
    def all_greedy(self) -> bool:
        """Whether every row is greedy (temperature 0)."""
        return all(p.greedy for p in self.params)


@dataclass(slots=True)
class SamplerOutput:
    # Chosen token per row, int64 [num_rows], on the logits' device (the engine reads it with one sync).
    token_ids: torch.Tensor
    # Log-probability of each chosen token under the raw model distribution (before penalties, temperature and
    # filters), float32 [num_rows]; None when no row asked for logprobs.
    logprobs: torch.Tensor | None = None
    # Top-n alternatives per row, best first: ids and raw log-probabilities, [num_rows, max_n] where max_n is the
    # largest n any row asked for (the engine trims each row to its own n); None when no row asked.
    top_token_ids: torch.Tensor | None = None
    # Their raw log-probabilities, float32 [num_rows, max_n], row by row in the order of ``top_token_ids``.
    top_logprobs: torch.Tensor | None = None


class Sampler(ABC):
    """One instance per engine, called once per step on the engine's thread."""

    #: True for a sampler that only ever returns each row's argmax, whatever the row's temperature, filters and
    #: seed. The conformance suite then holds every row to the argmax instead of checking how it draws, and
    #: ``rtx plugins list`` shows it as greedy only.
    greedy_only: ClassVar[bool] = False

    @classmethod
    def describe(cls) -> dict[str, Any]:
        """What ``rtx plugins list`` shows (the parameters it honours, say)."""
        return {"greedy_only": True} if cls.greedy_only else {}

    @abstractmethod
    def sample(self, logits: torch.Tensor, batch: SamplingBatch) -> SamplerOutput:
        """:param logits: float tensor [num_rows, vocab_size] from the backend, on its device (may be modified in
            place).
        :param batch: one :class:`SamplingParams`, token history and generator per row, in row order.
        :returns: the chosen tokens, honouring each row's :class:`SamplingParams` (penalties included), and the raw
            log-probabilities the rows asked for."""

    def target_probs(self, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor | None:
        """The distribution each row is drawn from, [num_rows, vocab_size], for samplers that truncate it further
        than top-k / top-p / min-p (typical-p, mirostat); ``None`` (the default) means the standard one: softmax of
        ``logits / temperature`` restricted to the top-k, top-p and min-p set and renormalized. The conformance
        suite checks that the declared distribution is such a truncation and that draws follow it. It asks only
        about sampled rows (temperature above 0): a greedy row's draw is its argmax, whatever this returns for it.
        Must not modify ``logits``."""
        return None
