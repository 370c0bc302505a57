"""The ``ngram`` proposer (prompt lookup decoding): propose what followed the latest earlier occurrence of the
sequence's last n tokens in its prompt or output. Free to run and strong on input-grounded work (rewriting,
summarising, editing code), where the output copies spans of the input.

Options: ``prompt_lookup_min`` (shortest n-gram matched, default 1) and ``prompt_lookup_max`` (longest, default 4).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from rtx_plugins.proposers.lookup import lookup_continuation
from rtxcore.contracts.proposer import Proposer, ProposerContext
from rtxcore.errors import ConfigError
from rtxcore.hookspecs import Register, hookimpl
from rtxcore.request import Request


class NgramProposer(Proposer):
    def __init__(self, context: ProposerContext):
        super().__init__(context)
        options = dict(context.options)
        self.min_n = _int_option(options, "prompt_lookup_min", 1)
        self.max_n = _int_option(options, "prompt_lookup_max", 4)
        if options:
            raise ConfigError(f"unknown ngram option {sorted(options)[0]!r} (options: prompt_lookup_min, "
                              "prompt_lookup_max)")
        if not 1 <= self.min_n <= self.max_n:
            raise ConfigError(f"ngram needs 1 <= prompt_lookup_min <= prompt_lookup_max, got {self.min_n} and "
                              f"{self.max_n}")

    @classmethod
    def describe(cls) -> dict[str, Any]:
        return {"method": "prompt lookup", "options": ["prompt_lookup_min", "prompt_lookup_max"]}

    def propose(self, reqs: Sequence[Request], num_tokens: Sequence[int]) -> list[list[int]]:
        proposals = []
        for req, k in zip(reqs, num_tokens):
            tokens = np.asarray(req.all_token_ids, dtype=np.int64)
            proposals.append(lookup_continuation(tokens, tokens[-self.max_n:], k, self.min_n, self.max_n,
                                                 exclude_tail=True))
        return proposals


def _int_option(options: dict[str, Any], name: str, default: int) -> int:
    value = options.pop(name, default)
    try:
        return int(value)
    except (TypeError, ValueError):
        raise ConfigError(f"ngram option {name} must be an integer, got {value!r}") from None


@hookimpl
def register_proposers(register: Register) -> None:
    register("ngram", NgramProposer)
