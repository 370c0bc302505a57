"""``min_tokens`` (vLLM's): until a request has generated that many tokens, the tokens that would end it (its
end-of-sequence tokens, unless it ignores them, and its stop tokens) cannot be sampled.

A row whose other processors left nothing but ending tokens (``allowed_token_ids`` of only those, a complete grammar)
keeps them, where holding them back would leave nothing to sample: the output ends there, short of the minimum. To
see what the others left, it applies after them (``applies_last``).

Stateless: a row's count comes with it (``RowContext.num_generated``, which includes tokens an overlapped step has
not read yet), so requests with a minimum keep their steps overlapped. Stop strings are the detokenizer's part of
the rule (``IncrementalDetokenizer``'s ``min_tokens``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import torch

from rtxcore.contracts.logits_processor import LogitsProcessor, RowContext
from rtxcore.hookspecs import Register, hookimpl
from rtxcore.sampling_params import is_int
from rtxcore.transfer import to_device


class _Minimum(NamedTuple):
    min_tokens: int
    # The tokens held back until then.
    ending_ids: tuple[int, ...]


class MinTokens(LogitsProcessor):
    applies_last = True
    @classmethod
    def describe(cls) -> dict[str, Any]:
        return {"example_args": [3, {"min_tokens": 2, "stop_token_ids": [1], "ignore_eos": False}]}

    def prepare(self, args: Any) -> _Minimum:
        # A request's min_tokens field arrives as the object form; the logits_processors map may give a bare count.
        if is_int(args):
            args = {"min_tokens": args}
        if not isinstance(args, dict) or set(args) - {"min_tokens", "stop_token_ids", "ignore_eos"}:
            raise ValueError("expected a count, or an object of min_tokens, stop_token_ids and ignore_eos")
        count = args.get("min_tokens")
        stop_ids = args.get("stop_token_ids", [])
        ignore_eos = args.get("ignore_eos", False)
        if not is_int(count) or count < 0:
            raise ValueError(f"min_tokens must be a non-negative integer, got {count!r}")
        if not isinstance(stop_ids, list) or not all(is_int(t) for t in stop_ids) or not isinstance(ignore_eos, bool):
            raise ValueError("stop_token_ids must be a list of token ids and ignore_eos true or false")
        vocab = self.context.vocab_size
        # A stop token outside the vocabulary can never be sampled: nothing to hold back.
        ending = [t for t in stop_ids if 0 <= t < vocab] + ([] if ignore_eos else self.context.eos_token_ids)
        return _Minimum(count, tuple(dict.fromkeys(ending)))

    def new_state(self, prepared: Any, output_token_ids: Sequence[int]) -> Any:
        return prepared

    def apply(self, logits: torch.Tensor, rows: Sequence[RowContext]) -> None:
        held: list[int] = []  # rows below their minimum
        row_ids: list[int] = []  # (index into held, token id) of each token held back
        token_ids: list[int] = []
        for r in rows:
            minimum: _Minimum = r.state
            if r.num_generated < minimum.min_tokens and minimum.ending_ids:
                row_ids += [len(held)] * len(minimum.ending_ids)
                token_ids += minimum.ending_ids
                held.append(r.row)
        if not held:  # once every request is past its minimum, a step costs this loop and no device work
            return
        index = to_device(held + row_ids + token_ids, torch.long, logits.device)
        rows_t, pair_rows, pair_tokens = index[:len(held)], index[len(held):-len(token_ids)], index[-len(token_ids):]
        ending = torch.zeros((len(held), logits.shape[1]), dtype=torch.bool, device=logits.device)
        ending[pair_rows, pair_tokens] = True
        # A row whose other processors left only ending tokens keeps them, rather than nothing to sample (the sampler
        # would draw token 0 from a row of -inf). Decided on the device: no sync.
        others_left = ((logits[rows_t] > float("-inf")) & ~ending).any(dim=-1)
        where = rows_t[pair_rows], pair_tokens
        logits[where] = torch.where(others_left[pair_rows], float("-inf"), logits[where])


@hookimpl
def register_logits_processors(register: Register) -> None:
    register("min_tokens", MinTokens)
