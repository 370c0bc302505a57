"""The ``fault_injection`` logits processor, for chaos drills (``rtx chaos``): a request that asks for it with
``"logits_processors": {"fault_injection": {"fail_after_tokens": 3}}`` makes the processor raise once the request has
that many tokens, as a third-party plugin with a bug on some inputs would. The engine must fail that request alone.

Registered only when ``RTX_FAULT_INJECTION`` is on: a production server never offers it, and ``rtx plugins test``
(which it would fail, by design) never sees it there.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from rtxcore import envs
from rtxcore.contracts.logits_processor import LogitsProcessor, RowContext
from rtxcore.hookspecs import Register, hookimpl


class InjectedFault(RuntimeError):
    """What the processor raises: a plugin failing on one request."""


class FaultInjection(LogitsProcessor):
    @classmethod
    def describe(cls) -> dict[str, Any]:
        return {"description": "raises once a request has fail_after_tokens tokens (chaos drills only)",
                "example_args": [{"fail_after_tokens": 2}]}

    def prepare(self, args: Any) -> int:
        after = args.get("fail_after_tokens") if isinstance(args, dict) else None
        if isinstance(after, bool) or not isinstance(after, int) or after < 0:
            raise ValueError('fault_injection takes {"fail_after_tokens": N}, N >= 0')
        return after

    def new_state(self, prepared: int, output_token_ids: Sequence[int]) -> list[int]:
        return [prepared, len(output_token_ids)]

    def apply(self, logits: torch.Tensor, rows: Sequence[RowContext]) -> None:
        for row in rows:
            after, seen = row.state
            if seen + len(row.proposed) >= after:
                raise InjectedFault(f"injected fault after {after} tokens")

    def advance(self, state: list[int], token_ids: Sequence[int]) -> None:
        state[1] += len(token_ids)


@hookimpl
def register_logits_processors(register: Register) -> None:
    if envs.RTX_FAULT_INJECTION.get():
        register("fault_injection", FaultInjection)
