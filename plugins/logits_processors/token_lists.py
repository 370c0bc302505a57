"""Logits processors over fixed token lists: ``logit_bias`` (OpenAI's), ``allowed_tokens`` and ``banned_tokens``.

Their state is the request's list itself; each step applies every row's list in one scatter on the device.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from rtxcore.contracts.logits_processor import LogitsProcessor, RowContext
from rtxcore.hookspecs import Register, hookimpl
from rtxcore.sampling_params import is_int
from rtxcore.transfer import to_device


class _TokenListProcessor(LogitsProcessor):
    def _check_ids(self, token_ids: Any) -> list[int]:
        # Arguments may come straight from a request's JSON (logits_processors): anything wrong is a ValueError.
        if not isinstance(token_ids, (list, tuple)) or not all(is_int(t) for t in token_ids):
            raise ValueError("expected a list of token ids")
        vocab = self.context.vocab_size
        bad = [t for t in token_ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"token id {bad[0]} is outside the vocabulary [0, {vocab})")
        return list(dict.fromkeys(token_ids))

    def new_state(self, prepared: Any, output_token_ids: Sequence[int]) -> Any:
        return prepared

    def _indices(self, rows: Sequence[RowContext], logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(row index, token id) of every listed token of every row, on the logits' device in one copy."""
        row_ids: list[int] = []
        token_ids: list[int] = []
        for r in rows:
            ids = r.state[0] if isinstance(r.state, tuple) else r.state
            row_ids += [r.row] * len(ids)
            token_ids += ids
        both = to_device(row_ids + token_ids, torch.long, logits.device)
        return both[:len(row_ids)], both[len(row_ids):]


class LogitBias(_TokenListProcessor):
    """Adds each listed token's bias to its logit (before temperature, as OpenAI does)."""

    @classmethod
    def describe(cls) -> dict[str, Any]:
        return {"example_args": [{5: 50.0, 7: -100.0}]}

    def prepare(self, args: Any) -> tuple[list[int], list[float]]:
        if not isinstance(args, dict) or not all(isinstance(v, (int, float)) and not isinstance(v, bool)
                                                 and -100 <= v <= 100 for v in args.values()):
            raise ValueError("expected an object of token id -> bias, a number in [-100, 100]")
        # JSON object keys are strings: "42" is token 42, as in OpenAI's logit_bias.
        bias = {int(k) if isinstance(k, str) and k.isdigit() else k: v for k, v in args.items()}
        ids = self._check_ids(list(bias))
        return ids, [float(bias[t]) for t in ids]

    def apply(self, logits: torch.Tensor, rows: Sequence[RowContext]) -> None:
        row_idx, token_idx = self._indices(rows, logits)
        values = to_device([v for r in rows for v in r.state[1]], logits.dtype, logits.device)
        logits.index_put_((row_idx, token_idx), values, accumulate=True)


class AllowedTokens(_TokenListProcessor):
    """Only the listed tokens may be sampled."""

    @classmethod
    def describe(cls) -> dict[str, Any]:
        return {"example_args": [[3, 5, 7]]}

    def prepare(self, args: Any) -> list[int]:
        ids = self._check_ids(args)
        if not ids:
            raise ValueError("at least one token must be allowed")
        return ids

    def apply(self, logits: torch.Tensor, rows: Sequence[RowContext]) -> None:
        row_idx, token_idx = self._indices(rows, logits)
        keep = torch.zeros_like(logits, dtype=torch.bool)
        keep[row_idx, token_idx] = True
        rows_used = to_device([r.row for r in rows], torch.long, logits.device)
        # Only the processor's rows: others in the batch keep their whole vocabulary.
        logits[rows_used] = logits[rows_used].masked_fill(~keep[rows_used], float("-inf"))


class BannedTokens(_TokenListProcessor):
    """The listed tokens are never sampled."""

    @classmethod
    def describe(cls) -> dict[str, Any]:
        return {"example_args": [[1, 2]]}

    def prepare(self, args: Any) -> list[int]:
        ids = self._check_ids(args)
        if len(ids) >= self.context.vocab_size:  # ids are distinct and inside the vocabulary
            raise ValueError("bans every token of the vocabulary: nothing could be sampled")
        return ids

    def apply(self, logits: torch.Tensor, rows: Sequence[RowContext]) -> None:
        row_idx, token_idx = self._indices(rows, logits)
        logits[row_idx, token_idx] = float("-inf")


@hookimpl
def register_logits_processors(register: Register) -> None:
    register("logit_bias", LogitBias)
    register("allowed_tokens", AllowedTokens)
    register("banned_tokens", BannedTokens)
