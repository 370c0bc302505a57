"""The ``assisted`` proposer: tokens the caller expects (the OpenAI ``prediction`` parameter, ``draft_token_ids``
on ``/generate`` and gRPC), proposed and verified like any others. The engine uses it for every request that brings
such tokens, whatever proposer the server runs.

While the output follows the prediction, the next predicted tokens are proposed; once it departs (an edit), the
output's last tokens are looked up in the prediction and what followed them there is proposed, so a prediction that
differs from the output in places still pays after each difference.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from rtx_plugins.proposers.lookup import lookup_continuation
from rtxcore.contracts.proposer import Proposer
from rtxcore.hookspecs import Register, hookimpl
from rtxcore.request import Request

# n-grams of the output looked up in the prediction after the output departs from it.
_MIN_N, _MAX_N = 1, 4


class AssistedProposer(Proposer):
    @classmethod
    def describe(cls) -> dict[str, Any]:
        return {"method": "caller-supplied tokens (prediction, draft_token_ids)"}

    def propose(self, reqs: Sequence[Request], num_tokens: Sequence[int]) -> list[list[int]]:
        proposals = []
        for req, k in zip(reqs, num_tokens):
            predicted = req.draft_token_ids or []
            output = req.output_token_ids
            m = len(output)
            if predicted[:m] == output:
                proposals.append(predicted[m:m + k])
                continue
            proposals.append(lookup_continuation(np.asarray(predicted, dtype=np.int64),
                                                 np.asarray(output[-_MAX_N:], dtype=np.int64), k, _MIN_N, _MAX_N,
                                                 exclude_tail=False))
        return proposals


@hookimpl
def register_proposers(register: Register) -> None:
    register("assisted", AssistedProposer)
