"""Per-request generation options, validated once when the request is made."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from rtxcore.errors import InvalidRequestError

# The kinds of structured output (rtx_plugins.logits_processors.structured_output): exactly one per request.
STRUCTURED_OUTPUT_KINDS = ("json", "json_object", "regex", "choice", "grammar")


@dataclass(slots=True)
class SamplingParams:
    max_tokens: int = 16
    # 0 means greedy; temperature scales logits before top-k / top-p / min-p filtering. Values below 1e-5 are taken
    # as 0 (vLLM's epsilon too): dividing float32 logits by a subnormal overflows them to infinity.
    temperature: float = 1.0
    top_k: int = 0  # 0 disables
    top_p: float = 1.0
    min_p: float = 0.0
    # HF-style: logits of tokens already in prompt or output are divided (positive) / multiplied (negative) by it.
    repetition_penalty: float = 1.0
    # OpenAI-style, applied to tokens of the output: presence once, frequency per occurrence.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    # Tokens generated before the end-of-sequence token or a stop token may be sampled and before a stop string
    # ends the output (vLLM's min_tokens); at most max_tokens. 0: no minimum.
    min_tokens: int = 0
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    # Number of most likely alternatives returned with each sampled token's log-probability; None returns none.
    logprobs: int | None = None
    skip_special_tokens: bool = True
    # Early exit (with a proposer that drafts through the model's first layers, --speculative layer-skip): a drafted
    # token whose probability at the exit layer reaches this is emitted as it is, without the full model's say.
    # Trades quality for speed (docs/speculative.md measures the cost); None (the default) keeps the full model's.
    early_exit_threshold: float | None = None
    # Logits processors (rtxcore.contracts.logits_processor). OpenAI's logit_bias: token id -> added to its logit,
    # in [-100, 100] (keys may be strings of digits, as JSON objects have them).
    logit_bias: dict[int, float] | None = None
    # Only these tokens may be sampled (vLLM's allowed_token_ids); these never may.
    allowed_token_ids: list[int] | None = None
    banned_token_ids: list[int] | None = None
    # Output held to a grammar: one of {"json": <JSON schema>}, {"json_object": true}, {"regex": <pattern>},
    # {"choice": [<strings>]}, {"grammar": <EBNF or Lark text>}.
    structured_output: dict[str, Any] | None = None
    # Other installed logits processors by registered name -> their arguments (JSON values).
    logits_processors: dict[str, Any] = field(default_factory=dict)

    def processor_args(self) -> dict[str, Any]:
        """Every logits processor this request uses, by registered name, with its arguments."""
        args: dict[str, Any] = {}
        if self.logit_bias:
            args["logit_bias"] = self.logit_bias
        if self.allowed_token_ids is not None:
            args["allowed_tokens"] = self.allowed_token_ids
        if self.banned_token_ids:
            args["banned_tokens"] = self.banned_token_ids
        if self.structured_output is not None:
            args["structured_output"] = self.structured_output
        if self.min_tokens:
            args["min_tokens"] = {"min_tokens": self.min_tokens, "stop_token_ids": self.stop_token_ids,
                                  "ignore_eos": self.ignore_eos}
        args.update(self.logits_processors)
        return args

    @property
    def needs_output_history(self) -> bool:
        """Whether sampling this request's next token depends on the tokens generated before it (penalties)."""
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        _check(is_int(self.max_tokens), f"max_tokens must be an integer, got {self.max_tokens!r}", "max_tokens")
        _check(self.max_tokens > 0, f"max_tokens must be at least 1, got {self.max_tokens}", "max_tokens")
        for name in ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _check(is_finite_number(value), f"{name} must be a finite number, got {_short(value)}", name)
        _check(self.temperature >= 0, f"temperature must be >= 0, got {self.temperature}", "temperature")
        if self.temperature < MIN_TEMPERATURE:
            self.temperature = 0.0
        _check(is_int(self.top_k) and self.top_k >= 0,
               f"top_k must be an integer >= 0 (0 disables it), got {self.top_k!r}", "top_k")
        _check(0 < self.top_p <= 1, f"top_p must be in (0, 1], got {_short(self.top_p)}", "top_p")
        _check(0 <= self.min_p <= 1, f"min_p must be in [0, 1], got {_short(self.min_p)}", "min_p")
        _check(MIN_REPETITION_PENALTY <= self.repetition_penalty <= MAX_REPETITION_PENALTY,
               f"repetition_penalty must be in [{MIN_REPETITION_PENALTY:g}, {MAX_REPETITION_PENALTY:g}], got "
               f"{_short(self.repetition_penalty)}", "repetition_penalty")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _check(-2 <= value <= 2, f"{name} must be in [-2, 2], got {_short(value)}", name)
        _check(self.seed is None or (is_int(self.seed) and -2**63 <= self.seed < 2**63),
               f"seed must be a 64-bit integer, in [-2**63, 2**63), got {self.seed!r}", "seed")
        if self.seed is not None and self.seed < 0:
            # OpenAI's and vLLM's seeds are any int64; the engine's generators and their derived seeds (a resumed
            # request's, choice j's) count in [0, 2**63). Taken modulo, a negative seed stays reproducible.
            self.seed %= 2**63
        _check(all(isinstance(s, str) and s for s in self.stop), "stop strings must be non-empty strings", "stop")
        _check(all(is_int(t) and t >= 0 for t in self.stop_token_ids),
               "stop_token_ids must be non-negative integers", "stop_token_ids")
        _check(is_int(self.min_tokens) and 0 <= self.min_tokens <= self.max_tokens,
               f"min_tokens must be an integer in [0, max_tokens={self.max_tokens}], got {self.min_tokens!r}",
               "min_tokens")
        _check(self.logprobs is None or (is_int(self.logprobs) and 0 <= self.logprobs <= 20),
               f"logprobs must be an integer in [0, 20], got {self.logprobs!r}", "logprobs")
        _check(self.early_exit_threshold is None or (is_finite_number(self.early_exit_threshold)
                                                     and 0 < self.early_exit_threshold <= 1),
               f"early_exit_threshold must be in (0, 1], got {self.early_exit_threshold!r}", "early_exit_threshold")
        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens"):
            value = getattr(self, name)
            _check(isinstance(value, bool), f"{name} must be true or false, got {value!r}", name)
        self._check_processor_fields()

    def _check_processor_fields(self) -> None:
        if self.logit_bias is not None:
            _check(isinstance(self.logit_bias, dict), "logit_bias must be an object of token id -> bias", "logit_bias")
            bias: dict[int, float] = {}
            for key, value in self.logit_bias.items():
                token = int(key) if isinstance(key, str) and key.isascii() and key.isdigit() else key
                _check(is_int(token) and token >= 0, f"logit_bias keys must be token ids, got {key!r}", "logit_bias")
                _check(is_finite_number(value) and -100 <= value <= 100,
                       f"logit_bias values must be numbers in [-100, 100], got {value!r} for token {key}",
                       "logit_bias")
                bias[token] = float(value)
            self.logit_bias = bias
        for name in ("allowed_token_ids", "banned_token_ids"):
            ids = getattr(self, name)
            _check(ids is None or (isinstance(ids, list) and all(is_int(t) and t >= 0 for t in ids)),
                   f"{name} must be a list of token ids", name)
        _check(self.allowed_token_ids != [], "allowed_token_ids must not be empty", "allowed_token_ids")
        so = self.structured_output
        if so is not None:
            _check(isinstance(so, dict) and len(so) == 1 and next(iter(so)) in STRUCTURED_OUTPUT_KINDS,
                   f"structured_output must have exactly one of {', '.join(STRUCTURED_OUTPUT_KINDS)}",
                   "structured_output")
        _check(isinstance(self.logits_processors, dict) and all(isinstance(k, str) for k in self.logits_processors),
               "logits_processors must be an object of processor name -> arguments", "logits_processors")
        for name, field_name in PROCESSOR_FIELDS.items():
            # A built-in named in the map too would be given twice, the map's silently winning.
            _check(not (name in self.logits_processors and getattr(self, field_name) not in (None, {}, [], 0)),
                   f"{name} is given twice: as {field_name} and in logits_processors", "logits_processors")
        # Allowed and banned tokens from their fields or the map: every allowed one banned leaves nothing to sample.
        allowed = self.logits_processors.get("allowed_tokens", self.allowed_token_ids)
        banned = self.logits_processors.get("banned_tokens", self.banned_token_ids)
        where = "banned_token_ids" if self.banned_token_ids else "logits_processors"
        _check(not (isinstance(allowed, list) and allowed and isinstance(banned, list)
                    and all(is_int(t) for t in allowed + banned) and set(allowed) <= set(banned)),
               f"{where}: the banned tokens ban every token the allowed tokens allow: nothing could be sampled", where)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


# The built-in logits processors and the request field each takes its arguments from (processor_args).
PROCESSOR_FIELDS = {"logit_bias": "logit_bias", "allowed_tokens": "allowed_token_ids",
                    "banned_tokens": "banned_token_ids", "structured_output": "structured_output",
                    "min_tokens": "min_tokens"}
# The smallest temperature taken as given; below it, greedy (see SamplingParams.temperature).
MIN_TEMPERATURE = 1e-5
# repetition_penalty's range. A seen token's positive logit is divided by the penalty: far below this bound it
# overflows float32 (at 1e-38 sampling drew end-of-text tokens the model gave 1e-5), and far above it every seen
# negative logit becomes -inf. Usual values are 1 to 2.
MIN_REPETITION_PENALTY, MAX_REPETITION_PENALTY = 1e-3, 1e3


def is_int(value: object) -> bool:
    # bool is an int subclass: True would pass as 1 here and fail later, on the engine's thread.
    return isinstance(value, int) and not isinstance(value, bool)


def is_finite_number(value: object) -> bool:
    """A finite int or float (not a bool): NaN and infinities (JSON's 1e400 parses as inf) are refused."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    try:
        return math.isfinite(float(value))
    except OverflowError:  # an int past float's range
        return False


def _short(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 40 else f"{text[:37]}..."


def _check(ok: bool, message: str, param: str) -> None:
    if not ok:
        raise InvalidRequestError(message, param=param)
