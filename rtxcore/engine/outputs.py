"""What the engine hands back for each request after each step."""

from __future__ import annotations

from dataclasses import dataclass, field

# The lowest log-probability handed back: a token a logits processor forbids has -inf, which JSON cannot carry
# (a strict client's parser fails on it), so it is reported as this, as vLLM's OpenAI server does.
LOGPROB_FLOOR = -9999.0
# The token the engine reads for a row its logits processors left nothing to sample (every logit -inf or NaN): the
# request fails there, naming its processors, instead of emitting whatever the sampler drew from such a row.
NO_TOKEN = -1


@dataclass(slots=True)
class TokenLogprob:
    token_id: int
    logprob: float
    # The most likely alternatives at this position: (token_id, logprob), best first.
    top: list[tuple[int, float]] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class RequestFailure:
    """Why a request ended with an error (:mod:`rtxcore.engine.faults`): the kind of plugin at fault (the ``cause``
    label of ``rtx_request_failures_total``), its name, and the exception in one line."""

    cause: str
    plugin: str
    message: str
    # The request field at fault when the request's own arguments could not go on (a logits processor's
    # RequestArgumentError: a client error); None when the plugin failed.
    param: str | None = None

    def describe(self) -> str:
        if self.param is not None:
            return f"{self.param}: {self.message}"
        return f"{self.cause} plugin {self.plugin!r} failed on this request: {self.message}"


@dataclass(slots=True)
class RequestTimings:
    """When a request passed each stage, on the ``time.monotonic()`` clock (seconds); for metrics and timelines."""

    # The engine accepted the request (``add_request``).
    arrival_time: float
    # The request's first step ran; None if it never ran (aborted while queued).
    first_scheduled_time: float | None
    # Its first token was sampled; None if none was.
    first_token_time: float | None
    # It finished or was aborted.
    finish_time: float
    # Times it was preempted and had to recompute.
    num_preemptions: int = 0


@dataclass(slots=True)
class RequestOutput:
    req_id: str
    # Tokens generated this step (usually one; none while a prompt is still being prefilled).
    new_token_ids: list[int]
    # Text finalized this step (may lag tokens while a character or a possible stop string is incomplete).
    new_text: str
    finished: bool = False
    # "stop" (EOS, stop token or stop string), "length" (max_tokens or context), "abort", or "error" (a plugin
    # failed on this request: see ``error``); None while running.
    finish_reason: str | None = None
    # The stop string or stop token id that ended the request, if any.
    stop_reason: str | int | None = None
    logprobs: list[TokenLogprob] | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    # Prompt tokens served from the prefix cache.
    num_cached_tokens: int = 0
    # Set on the final output only (``finished``).
    timings: RequestTimings | None = None
    # Final output only: the caller's predicted tokens the model accepted and refused (speculative decoding).
    num_accepted_prediction_tokens: int = 0
    num_rejected_prediction_tokens: int = 0
    # Final output only, when finish_reason is "error": which plugin failed and how.
    error: RequestFailure | None = None


@dataclass(slots=True)
class CompletionResult:
    """A finished request, assembled from its stream (offline use)."""

    req_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str | None
    num_cached_tokens: int = 0
    logprobs: list[TokenLogprob] | None = None
    # Why it ended with finish_reason "error".
    error: RequestFailure | None = None
