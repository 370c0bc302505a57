"""Request bodies of the HTTP API, parsed and checked into plain dataclasses and :class:`SamplingParams`.

Every problem raises :class:`InvalidRequestError` naming the offending field (answered as 400 with ``param``).
OpenAI routes ignore fields they do not know, as OpenAI's clients send extras; the native routes refuse them.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from rtxcore.errors import InvalidRequestError
from rtxcore.lanes import check_lane_name
from rtxcore.sampling_params import SamplingParams, is_int
from rtxcore.server.http.chat_messages import parse_message
from rtxcore.server.http.chat_template_fields import ChatTemplateFields, parse_chat_template_fields
from rtxcore.server.http.fields import bool_field, flag_field, int_field, model_field
from rtxcore.server.http.structured_fields import structured_output, structured_output_field
from rtxcore.server.serving.limits import MAX_BATCH
from rtxcore.server.serving.tool_calls import ToolRequest, parse_tools, required_grammar

# A prompt as the API takes it: text, or token ids.
Prompt = str | list[int]

# truncate_prompt_tokens: keep a prompt's last N tokens; CONTEXT keeps as many as the model's context holds.
Truncation = int | None
CONTEXT = -1

# Chat's default max_tokens is what is left of the context, but no more than this.
DEFAULT_CHAT_MAX_TOKENS = 4096
_SAMPLING_FIELDS = frozenset(f.name for f in fields(SamplingParams))
# Every field /generate takes; it refuses any other.
GENERATE_FIELDS = _SAMPLING_FIELDS | {"prompt", "stream", "lane", "cache_salt", "draft_token_ids", "speculative"}


@dataclass(slots=True, frozen=True)
class RoutingFields:
    """Where a request runs and what it may share: extensions of the OpenAI body (as vLLM has ``cache_salt``)."""

    # SLA lane; None leaves it to the ``x-rtx-lane`` header or the tenant's default.
    lane: str | None = None
    # Only requests with the same salt (and tenant) share prefix-cache blocks.
    cache_salt: str | None = None


@dataclass(slots=True, frozen=True)
class SpeculationFields:
    """What a request asks of speculative decoding, as its body says it (one of the first two, or neither)."""

    # OpenAI's ``prediction``: the expected output as text (its text parts joined), encoded before submission.
    prediction: str | None = None
    # /generate's ``draft_token_ids``: the expected output as token ids (checked against the vocabulary later).
    draft_token_ids: list[int] | None = None
    # ``speculative: false`` (an extension): the request never speculates.
    speculative: bool = True


@dataclass(slots=True)
class CompletionRequest:
    model: str | None
    # One choice per prompt, in order.
    prompts: list[Prompt]
    # max_tokens is filled in before submission (chat's default depends on the prompt's length).
    params: dict[str, Any]
    stream: bool
    include_usage: bool
    routing: RoutingFields
    speculation: SpeculationFields
    # Choices returned per prompt; ``best_of`` of them are sampled and the ``n`` with the highest cumulative
    # log-probability returned (best_of == n: all of them, in order).
    n: int = 1
    best_of: int = 1
    # Whether each choice's text (and logprobs) starts with its prompt's.
    echo: bool = False
    # Keep only the last this many tokens of each prompt (vLLM's truncate_prompt_tokens); None keeps them all.
    truncation: Truncation = None


@dataclass(slots=True)
class ChatRequest:
    model: str | None
    messages: list[dict[str, Any]]
    params: dict[str, Any]
    # None: the default, what is left of the context.
    max_tokens: int | None
    stream: bool
    include_usage: bool
    routing: RoutingFields
    speculation: SpeculationFields
    # tools, tool_choice, parallel_tool_calls; None without tools.
    tools: ToolRequest | None = None
    # Choices sampled for the conversation.
    n: int = 1
    # How the chat template renders the messages.
    template: ChatTemplateFields = ChatTemplateFields()
    # As CompletionRequest's, for the rendered chat.
    truncation: Truncation = None


@dataclass(slots=True)
class EmbeddingRequest:
    model: str | None
    inputs: list[Prompt]
    # "float" or "base64" (little-endian float32), as OpenAI's API offers.
    encoding_format: str
    # As CompletionRequest's, for each input.
    truncation: Truncation = None


@dataclass(slots=True)
class GenerateRequest:
    """The native ``/generate``: one prompt, :class:`SamplingParams` fields at the top level."""

    prompt: Prompt
    params: dict[str, Any]
    stream: bool
    routing: RoutingFields
    speculation: SpeculationFields


# -- OpenAI ------------------------------------------------------------------------------------------------------


def parse_completion(body: dict[str, Any]) -> CompletionRequest:
    echo = flag_field(body, "echo")
    if body.get("suffix") not in (None, ""):
        raise InvalidRequestError("suffix is not supported", param="suffix")
    if "prompt" not in body:
        raise InvalidRequestError("prompt is required", param="prompt")
    params = _openai_sampling(body)
    logprobs = body.get("logprobs")
    if logprobs is not None:
        params["logprobs"] = int_field(logprobs, "logprobs")
    max_tokens = body.get("max_tokens")
    params["max_tokens"] = 16 if max_tokens is None else max_tokens
    stream = flag_field(body, "stream")  # null is false, as in OpenAI's API
    prompts = parse_prompts(body["prompt"], "prompt")
    n, best_of = _num_choices(body, len(prompts))
    if best_of > n and stream:
        raise InvalidRequestError("best_of greater than n cannot stream: the best choices are known only at the end",
                                  param="best_of")
    return CompletionRequest(model_field(body), prompts, params, stream, _include_usage(body, stream),
                             parse_routing(body), _openai_speculation(body), n, best_of, echo, parse_truncation(body))


def parse_chat(body: dict[str, Any]) -> ChatRequest:
    n, _ = _num_choices(body, 1)
    tools = parse_tools(body)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise InvalidRequestError("messages must be a non-empty list of {'role', 'content'} objects",
                                  param="messages")
    params = _openai_sampling(body)
    if flag_field(body, "logprobs"):
        top = body.get("top_logprobs")
        params["logprobs"] = 0 if top is None else int_field(top, "top_logprobs", 0, 20)
    elif body.get("top_logprobs") is not None:
        raise InvalidRequestError("top_logprobs needs logprobs=true", param="top_logprobs")
    max_tokens = None
    for name in ("max_tokens", "max_completion_tokens"):  # the newer name wins, as in OpenAI's API; both checked
        if body.get(name) is not None:
            max_tokens = int_field(body[name], name, 1)
    stream = flag_field(body, "stream")  # null is false, as in OpenAI's API
    if tools is not None and tools.active and required_grammar(tools) is not None and "structured_output" in params:
        raise InvalidRequestError("tool_choice that requires a call cannot be combined with a structured output "
                                  f"({structured_output_field(body)})", param="tool_choice")
    return ChatRequest(model_field(body), [parse_message(m, i) for i, m in enumerate(messages)], params, max_tokens,
                       stream, _include_usage(body, stream), parse_routing(body), _openai_speculation(body), tools, n,
                       parse_chat_template_fields(body), parse_truncation(body))


def parse_embedding(body: dict[str, Any]) -> EmbeddingRequest:
    if "input" not in body:
        raise InvalidRequestError("input is required", param="input")
    _check_user(body)
    if body.get("dimensions") is not None:
        raise InvalidRequestError("dimensions is not supported: embeddings have the model's hidden size",
                                  param="dimensions")
    encoding = body.get("encoding_format") or "float"
    if encoding not in ("float", "base64"):
        raise InvalidRequestError("encoding_format must be 'float' or 'base64'", param="encoding_format")
    return EmbeddingRequest(model_field(body), parse_prompts(body["input"], "input"), encoding, parse_truncation(body))


def parse_prompts(value: Any, param: str) -> list[Prompt]:
    """A string, a list of strings, a list of token ids, or a list of token-id lists."""
    if isinstance(value, str):
        return [value]
    if not isinstance(value, list) or not value:
        raise InvalidRequestError(f"{param} must be a string, a list of strings, a list of token ids or a list of "
                                  f"token-id lists, and not empty", param=param)
    if all(is_int(t) for t in value):
        return [list(value)]
    if len(value) > MAX_BATCH:
        raise InvalidRequestError(f"{param} holds {len(value)} items; at most {MAX_BATCH} are accepted", param=param)
    prompts: list[Prompt] = []
    for item in value:
        if isinstance(item, str):
            prompts.append(item)
        elif isinstance(item, list) and item and all(is_int(t) for t in item):
            prompts.append(list(item))
        else:
            raise InvalidRequestError(f"each item of {param} must be a string or a non-empty list of token ids",
                                      param=param)
    if len({type(p) for p in prompts}) > 1:
        raise InvalidRequestError(f"{param} must be a list of strings or a list of token-id lists, not a mix of "
                                  "both", param=param)
    return prompts


# -- native ------------------------------------------------------------------------------------------------------


def parse_generate(body: dict[str, Any]) -> GenerateRequest:
    unknown = sorted(set(body) - GENERATE_FIELDS)
    if unknown:
        raise InvalidRequestError(f"unknown field {unknown[0]!r}", param=unknown[0])
    if "prompt" not in body:
        raise InvalidRequestError("prompt is required", param="prompt")
    prompt = body["prompt"]
    if not (isinstance(prompt, str) or (isinstance(prompt, list) and all(is_int(t) for t in prompt))):
        raise InvalidRequestError("prompt must be one string or one list of token ids", param="prompt")
    prompts = parse_prompts(prompt, "prompt")
    params = {k: v for k, v in body.items() if k in _SAMPLING_FIELDS}
    _check_lists(params)
    draft_token_ids = body.get("draft_token_ids")
    if draft_token_ids is not None and not (isinstance(draft_token_ids, list) and all(is_int(t) for t in
                                                                                       draft_token_ids)):
        raise InvalidRequestError("draft_token_ids must be a list of token ids", param="draft_token_ids")
    speculation = SpeculationFields(draft_token_ids=draft_token_ids,
                                    speculative=bool_field(body.get("speculative", True), "speculative"))
    return GenerateRequest(prompts[0], params, bool_field(body.get("stream", True), "stream"), parse_routing(body),
                           speculation)


def parse_embed(body: dict[str, Any]) -> list[Prompt]:
    unknown = sorted(set(body) - {"inputs"})
    if unknown:
        raise InvalidRequestError(f"unknown field {unknown[0]!r}", param=unknown[0])
    if "inputs" not in body:
        raise InvalidRequestError("inputs is required", param="inputs")
    return parse_prompts(body["inputs"], "inputs")


def parse_truncation(body: dict[str, Any]) -> Truncation:
    """vLLM's ``truncate_prompt_tokens``: a positive count, or -1 for the model's context."""
    value = body.get("truncate_prompt_tokens")
    if value is None or value == CONTEXT and is_int(value):
        return value
    return int_field(value, "truncate_prompt_tokens", 1)


def truncate_prompts(prompts: list[list[int]], truncation: Truncation, max_model_len: int) -> list[list[int]]:
    """Each prompt's last ``truncation`` tokens (CONTEXT: the context's worth)."""
    if truncation is None:
        return prompts
    keep = max_model_len if truncation == CONTEXT else truncation
    return [ids[-keep:] if len(ids) > keep else ids for ids in prompts]


def parse_routing(body: dict[str, Any]) -> RoutingFields:
    lane = body.get("lane")
    if lane is not None:
        check_lane_name(lane if isinstance(lane, str) else repr(lane))
    salt = body.get("cache_salt")
    if salt is not None and (not isinstance(salt, str) or not salt or len(salt) > 256):
        raise InvalidRequestError("cache_salt must be a non-empty string of at most 256 characters",
                                  param="cache_salt")
    return RoutingFields(lane, salt)


# -- sampling ----------------------------------------------------------------------------------------------------


def make_sampling_params(params: dict[str, Any]) -> SamplingParams:
    """:class:`SamplingParams` from checked fields; its own validation names the field that is wrong."""
    try:
        return SamplingParams(**params)
    except InvalidRequestError:
        raise
    except (TypeError, ValueError) as exc:  # a value of a type SamplingParams did not expect
        raise InvalidRequestError(f"invalid sampling parameters: {exc}") from None


def _openai_sampling(body: dict[str, Any]) -> dict[str, Any]:
    """The sampling fields OpenAI's completion and chat bodies share, plus vLLM's extensions."""
    _check_user(body)  # not sampling, but in both bodies
    params: dict[str, Any] = {}
    for name in ("temperature", "top_p", "presence_penalty", "frequency_penalty", "seed", "min_p",
                 "repetition_penalty", "ignore_eos", "include_stop_str_in_output", "skip_special_tokens",
                 "stop_token_ids", "early_exit_threshold", "min_tokens"):
        if body.get(name) is not None:
            params[name] = body[name]
    top_k = body.get("top_k")
    if top_k is not None:
        params["top_k"] = 0 if top_k == -1 else top_k  # vLLM spells "disabled" as -1
    for name in ("logit_bias", "allowed_token_ids", "banned_token_ids", "logits_processors"):
        if body.get(name) is not None:
            params[name] = body[name]
    structured = structured_output(body)
    if structured is not None:
        params["structured_output"] = structured
    stop = body.get("stop")
    if stop is not None:
        params["stop"] = [stop] if isinstance(stop, str) else stop
    _check_lists(params)
    return params


def _check_lists(params: dict[str, Any]) -> None:
    stop = params.get("stop")
    if isinstance(stop, str):
        params["stop"] = [stop]
    elif stop is not None and not (isinstance(stop, list) and all(isinstance(s, str) and s for s in stop)):
        raise InvalidRequestError("stop must be a string or a list of non-empty strings", param="stop")
    if len(params.get("stop") or []) > 16:
        raise InvalidRequestError("at most 16 stop strings are accepted", param="stop")
    ids = params.get("stop_token_ids")
    if ids is not None and not (isinstance(ids, list) and all(is_int(t) for t in ids)):
        raise InvalidRequestError("stop_token_ids must be a list of integers", param="stop_token_ids")
    for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens"):
        if name in params:
            bool_field(params[name], name)


def _openai_speculation(body: dict[str, Any]) -> SpeculationFields:
    # null is "not given", as for OpenAI's other optional fields.
    speculative = body.get("speculative")
    return SpeculationFields(prediction=_prediction(body.get("prediction")),
                             speculative=True if speculative is None else bool_field(speculative, "speculative"))


def _prediction(value: Any) -> str | None:
    """OpenAI's predicted output, ``{"type": "content", "content": text or [{"type": "text", "text": ...}]}``, as
    its text."""
    if value is None:
        return None
    content = value.get("content") if isinstance(value, dict) and value.get("type") == "content" else None
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(part, dict) and part.get("type") == "text" and
                                         isinstance(part.get("text"), str) for part in content):
        return "".join(part["text"] for part in content)
    raise InvalidRequestError("prediction must be {'type': 'content', 'content': <a string or a list of "
                              "{'type': 'text', 'text': <a string>} parts>}", param="prediction")


def _num_choices(body: dict[str, Any], num_prompts: int) -> tuple[int, int]:
    """``n`` and ``best_of`` (chat has no best_of: it stays 1 there, its field ignored as OpenAI's chat has none).
    Each sampled choice is an engine request: all of a request's together stay within :data:`MAX_BATCH`."""
    n = 1 if body.get("n") is None else int_field(body["n"], "n", 1, MAX_BATCH)
    best_of = n
    if "prompt" in body and body.get("best_of") is not None:
        best_of = int_field(body["best_of"], "best_of", 1, MAX_BATCH)
        if best_of < n:
            raise InvalidRequestError(f"best_of must be at least n ({n}), got {best_of}", param="best_of")
    if best_of * num_prompts > MAX_BATCH:
        param = "best_of" if best_of > n else "n"
        raise InvalidRequestError(f"{param} x prompts is {best_of * num_prompts}: at most {MAX_BATCH} choices are "
                                  "sampled per request", param=param)
    return n, best_of


def _include_usage(body: dict[str, Any], stream: bool) -> bool:
    options = body.get("stream_options")
    if options is None:
        return False
    if not stream:
        raise InvalidRequestError("stream_options is only allowed with stream=true", param="stream_options")
    if not isinstance(options, dict):
        raise InvalidRequestError("stream_options must be an object", param="stream_options")
    return bool_field(options.get("include_usage", False), "stream_options.include_usage")


def _check_user(body: dict[str, Any]) -> None:
    # OpenAI's end-user id: unused here, still refused when it is no string, as OpenAI does.
    if body.get("user") is not None and not isinstance(body["user"], str):
        raise InvalidRequestError("user must be a string", param="user")
