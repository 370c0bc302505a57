"""A generation request as the engine tracks it from arrival to finish."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Self

from rtxcore.sampling_params import SamplingParams

if TYPE_CHECKING:
    from rtxcore.engine.logits_processing import RequestLogits


class RequestStatus(enum.Enum):
    # Set on each member by __new__ from the second item of its value (an annotation, not a member).
    finished: bool

    WAITING = "waiting", False
    RUNNING = "running", False
    PREEMPTED = "preempted", False
    FINISHED_STOPPED = "stop", True
    FINISHED_LENGTH = "length", True
    FINISHED_ABORTED = "abort", True
    # A plugin failed on this request alone (rtxcore.engine.faults).
    FINISHED_ERROR = "error", True

    def __new__(cls, value: str, finished: bool) -> Self:
        member = object.__new__(cls)
        member._value_ = value
        # A plain attribute rather than a set lookup: it is read for every request every step, and enum members
        # hash in Python.
        member.finished = finished
        return member


@dataclass(slots=True, eq=False, repr=False)
class Request:
    req_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    # Prompt followed by every token generated so far; what a recompute after preemption must prefill again.
    all_token_ids: list[int] = field(default_factory=list)
    arrival_time: float = field(default_factory=time.monotonic)
    status: RequestStatus = RequestStatus.WAITING
    # Tokens whose KV entries are in the cache (prefix hits included).
    num_computed_tokens: int = 0
    # Prompt tokens found in the prefix cache when the request was first scheduled.
    num_cached_tokens: int = 0
    num_preemptions: int = 0
    # Mixed into block hashes so requests with different salts never share cached blocks.
    cache_salt: str | None = None
    # SLA lane (see rtxcore.lanes) and the tenant it was admitted for (None when unauthenticated).
    lane: str = "standard"
    tenant: str | None = None
    # Tokens sampled on the device whose values the host has not read yet (asynchronous scheduling): counted by
    # num_tokens, so the next step computes them, but not in all_token_ids.
    num_pending_tokens: int = 0
    # Speculative decoding: tokens a proposer guessed to follow all_token_ids, verified by the next step that
    # schedules them (counted by num_tokens_with_spec, not by num_tokens); emptied once verified.
    spec_token_ids: list[int] = field(default_factory=list)
    # Tokens the caller expects the output to be (OpenAI ``prediction``, ``draft_token_ids``): proposed from, and
    # verified like any proposal.
    draft_token_ids: list[int] | None = None
    # False: this request never speculates (a per-request opt-out).
    speculative: bool = True
    # Of the caller's tokens proposed so far: those the model accepted and those it refused (OpenAI's usage
    # accepted_prediction_tokens and rejected_prediction_tokens).
    num_accepted_draft_tokens: int = 0
    num_rejected_draft_tokens: int = 0
    # Its logits processors' prepared arguments and states (rtxcore.engine.logits_processing); None uses none.
    logits: RequestLogits | None = None
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finish_time: float | None = None
    # What output_token_ids returns, caught up with all_token_ids on each read rather than copied every step.
    _output_token_ids: list[int] = field(default_factory=list, init=False, repr=False)

    def __post_init__(self) -> None:
        if not self.all_token_ids:
            self.all_token_ids = list(self.prompt_token_ids)

    def __repr__(self) -> str:
        # No token ids, no parameters: a request's repr ends up in logs and error messages (a plugin's KeyError on
        # it), where a user's prompt does not belong.
        return (f"Request(req_id={self.req_id!r}, status={self.status.name}, "
                f"prompt_tokens={len(self.prompt_token_ids)}, output_tokens={self.num_output_tokens})")

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        """Tokens of the sequence so far, pending ones included."""
        return len(self.all_token_ids) + self.num_pending_tokens

    @property
    def num_tokens_with_spec(self) -> int:
        """Tokens a step may compute for this request: its sequence so far and the proposed tokens to verify."""
        return len(self.all_token_ids) + self.num_pending_tokens + len(self.spec_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.all_token_ids) - len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        """The tokens generated so far. The same list every time, extended as tokens arrive: read it, don't change it
        (the sampler reads it every step, and copying a long output each time would cost more than the step)."""
        cached = self._output_token_ids
        num_new = len(self.all_token_ids) - len(self.prompt_token_ids) - len(cached)
        if num_new == 1:  # read once per sampled token: the usual case
            cached.append(self.all_token_ids[-1])
        elif num_new != 0:
            cached[:] = self.all_token_ids[len(self.prompt_token_ids):]
        return cached

    @property
    def max_num_tokens(self) -> int:
        """Upper bound on this request's length: the KV space it may come to need."""
        return len(self.prompt_token_ids) + self.params.max_tokens

    @property
    def is_finished(self) -> bool:
        return self.status.finished
