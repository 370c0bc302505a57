"""What a caller sends, turned into a checked :class:`Request`: text encoded, token ids and lengths checked, the
outputs of a resumed request checked. Reads only what does not change while the engine runs (tokenizer, vocabulary,
context and cache sizes), so any thread may call it: servers encode on worker threads, never on the engine's."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from rtxcore.errors import CapacityError, InvalidRequestError
from rtxcore.lanes import DEFAULT_LANE, check_lane_name
from rtxcore.request import Request
from rtxcore.sampling_params import SamplingParams
from rtxcore.tokenizer import Tokenizer

if TYPE_CHECKING:
    from rtxcore.engine.logits_processing import LogitsProcessing

Prompt = str | Sequence[int]


@dataclass(slots=True, frozen=True)
class InputLimits:
    """The sizes a request is checked against."""

    vocab_size: int
    # Longest sequence (prompt + output) the engine accepts.
    max_model_len: int
    # Most tokens one request may ever hold in the KV cache (the whole cache, in whole blocks).
    max_cache_tokens: int
    block_size: int


class InputProcessor:
    def __init__(self, tokenizer: Tokenizer | None, limits: InputLimits, model_name: str,
                 logits: LogitsProcessing | None = None):
        self.tokenizer = tokenizer
        self.limits = limits
        if logits is None:  # none installed: a request asking for one is refused, naming the processor
            from rtxcore.engine.logits_processing import LogitsProcessing

            logits = LogitsProcessing({})
        # Prepares each request's logits processors (compiles its grammar) here, off the engine's thread.
        self.logits = logits
        # Named in errors about a missing tokenizer.
        self.model_name = model_name

    def make_request(self, prompt: Prompt, params: SamplingParams, req_id: str, *, cache_salt: str | None = None,
                     lane: str = DEFAULT_LANE, tenant: str | None = None,
                     output_token_ids: Sequence[int] = (), draft_token_ids: Sequence[int] | None = None,
                     speculative: bool = True) -> Request:
        """A request ready for the engine core.

        :param output_token_ids: tokens this request already produced (a request resumed from the journal after a
            restart): prefilled after the prompt and counted against ``params.max_tokens``, so generation goes on
            where it stopped.
        :param draft_token_ids: the output the caller expects (OpenAI ``prediction``): proposed to the target and
            verified, so it changes how fast the output comes, never what it is.
        :param speculative: False: the request never speculates, not even from ``draft_token_ids``.
        :raises InvalidRequestError: naming the problem (CapacityError when it can never fit).
        """
        check_lane_name(lane)
        token_ids = self.encode(prompt)
        outputs = self._check_token_ids(output_token_ids, "output token ids", "output_token_ids")
        if len(outputs) >= params.max_tokens:
            raise InvalidRequestError(f"{len(outputs)} output tokens already reach max_tokens ({params.max_tokens}): "
                                      "nothing is left to generate", param="output_token_ids")
        drafts = self._check_draft_token_ids(draft_token_ids or ())
        self._check_token_ids(params.stop_token_ids, "stop token ids", "stop_token_ids")
        self._check_fits(len(token_ids), params.max_tokens)
        logits = self.logits.prepare(params)
        # Checked even when unused, so a bad value is refused whatever the flag. Dropped when the request may not
        # speculate: the engine counts requests with draft tokens as speculating (an overlapped engine runs serial
        # steps while it has any), and this one never will.
        return Request(req_id, token_ids, params, all_token_ids=token_ids + outputs, cache_salt=cache_salt,
                       lane=lane, tenant=tenant, draft_token_ids=(drafts or None) if speculative else None,
                       speculative=speculative, logits=logits)

    def encode_prediction(self, text: str) -> list[int]:
        """Token ids of a predicted output given as text (OpenAI ``prediction``), for ``draft_token_ids``.

        Encoded without special tokens: the prediction continues the prompt, it does not start a sequence (a BOS
        in front would be refused by the first verification and waste it).

        :raises InvalidRequestError: naming ``prediction``: the model has no tokenizer, or the prediction is longer
            than the context.
        """
        if self.tokenizer is None:
            raise InvalidRequestError(f"model {self.model_name} has no tokenizer: a text prediction cannot be "
                                      "encoded", param="prediction")
        token_ids = self.tokenizer.encode(text, add_special_tokens=False)
        if len(token_ids) > self.limits.max_model_len:
            raise InvalidRequestError(f"prediction is {len(token_ids)} tokens, longer than the model's context of "
                                      f"{self.limits.max_model_len} tokens", param="prediction")
        return token_ids

    def encode(self, prompt: Prompt, param: str = "prompt") -> list[int]:
        """:param param: the request field the prompt came in, named in errors."""
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidRequestError(f"{param} is empty", param=param)
            if self.tokenizer is None:
                raise InvalidRequestError(f"model {self.model_name} has no tokenizer: give the {param} as token ids",
                                          param=param)
            token_ids = self.tokenizer.encode(prompt)
        else:
            token_ids = self._check_token_ids(prompt, f"{param} token ids", param)
        if not token_ids:
            raise InvalidRequestError(f"{param} is empty", param=param)
        return token_ids

    def encode_batch(self, prompts: Sequence[Prompt], param: str = "prompt") -> list[list[int]]:
        """Token ids of every prompt, texts encoded in one batch (the tokenizer's batch call is much faster than one
        call per text)."""
        texts = [p for p in prompts if isinstance(p, str)]
        if any(not p for p in prompts):
            raise InvalidRequestError(f"{param} is empty", param=param)
        if texts and self.tokenizer is None:
            raise InvalidRequestError(f"model {self.model_name} has no tokenizer: give the {param} as token ids",
                                      param=param)
        encoded = iter(self.tokenizer.encode_batch(texts) if texts and self.tokenizer is not None else [])
        # Token-id prompts are checked where they become requests (make_request, check_embedding_inputs).
        return [next(encoded) if isinstance(p, str) else list(p) for p in prompts]

    def check_embedding_inputs(self, token_lists: Sequence[Sequence[int]], param: str = "input") -> None:
        """Inputs already through :meth:`encode` (which checks their token ids) must fit the context.

        :raises CapacityError: an input is longer than the context (naming ``param``)."""
        for ids in token_lists:
            if len(ids) > self.limits.max_model_len:
                raise CapacityError(f"{param} is {len(ids)} tokens, longer than the model's context of "
                                    f"{self.limits.max_model_len} tokens", param=param)

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                            continue_final_message: bool = False,
                            template_vars: Mapping[str, Any] | None = None) -> str:
        """:param template_vars: the template's extra variables (``tools``, a request's ``chat_template_kwargs``)."""
        if self.tokenizer is None:
            raise InvalidRequestError(f"model {self.model_name} has no tokenizer and no chat template")
        return self.tokenizer.apply_chat_template(messages, add_generation_prompt, continue_final_message,
                                                  template_vars)

    def room_left(self, num_prompt_tokens: int) -> int:
        """Tokens a prompt of this length leaves to generate within the context and the whole KV cache."""
        return min(self.limits.max_model_len, self.limits.max_cache_tokens) - num_prompt_tokens

    def _check_fits(self, num_prompt_tokens: int, max_tokens: int) -> None:
        limits = self.limits
        total = num_prompt_tokens + max_tokens
        if num_prompt_tokens >= limits.max_model_len:
            raise CapacityError(f"prompt is {num_prompt_tokens} tokens, longer than the model's context of "
                                f"{limits.max_model_len} tokens (at least one must be left to generate)",
                                param="prompt")
        if total > limits.max_model_len:
            raise CapacityError(f"prompt ({num_prompt_tokens} tokens) plus max_tokens ({max_tokens}) is {total}, "
                                f"more than the model's context of {limits.max_model_len} tokens", param="max_tokens")
        if -(-total // limits.block_size) * limits.block_size > limits.max_cache_tokens:
            raise CapacityError(f"request needs up to {total} tokens of KV cache but the whole cache holds "
                                f"{limits.max_cache_tokens}", param="max_tokens")

    def _check_draft_token_ids(self, draft_token_ids: Sequence[int]) -> list[int]:
        drafts = self._check_token_ids(draft_token_ids, "draft token ids", "draft_token_ids")
        # More could never be verified: the whole sequence, prompt included, fits in the context.
        if len(drafts) > self.limits.max_model_len:
            raise InvalidRequestError(f"{len(drafts)} draft token ids are more than the model's context of "
                                      f"{self.limits.max_model_len} tokens", param="draft_token_ids")
        return drafts

    def _check_token_ids(self, token_ids: Sequence[int], what: str, param: str) -> list[int]:
        token_ids = list(token_ids)
        vocab = self.limits.vocab_size
        bad = [t for t in token_ids if not isinstance(t, int) or not 0 <= t < vocab]
        if bad:
            raise InvalidRequestError(f"{what} must be integers in [0, {vocab}); got {bad[0]!r}", param=param)
        return token_ids
