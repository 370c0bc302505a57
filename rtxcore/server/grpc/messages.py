"""Conversions between the gRPC messages of ``spec/rtx.proto`` and the engine's requests and outputs."""

from __future__ import annotations

import json
from typing import Any

from rtxcore.engine.outputs import RequestOutput
from rtxcore.errors import InvalidRequestError
from rtxcore.sampling_params import SamplingParams
from rtxcore.server.grpc.codegen import ensure_generated
from rtxcore.server.serving import strict_json
from rtxcore.server.serving.generation import Speculation

ensure_generated()
from rtxcore._generated import rtx_pb2  # noqa: E402

# Optional GenerateRequest fields copied to SamplingParams when set (proto3 `optional` tracks presence).
OPTIONAL_SAMPLING_FIELDS = ("max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "presence_penalty",
                            "frequency_penalty", "repetition_penalty", "logprobs", "early_exit_threshold",
                            "min_tokens", "skip_special_tokens")


def response_from_event(req_id: str, seq: int, event: dict) -> rtx_pb2.GenerateResponse:
    logprobs = [rtx_pb2.TokenLogprob(token_id=lp["token_id"], logprob=lp["logprob"],
                                     top=[rtx_pb2.TopLogprob(token_id=t, logprob=p) for t, p in lp["top"]])
                for lp in event["logprobs"]]
    return rtx_pb2.GenerateResponse(request_id=req_id, text=event["text"], token_ids=event["token_ids"],
                                    finished=event["finished"], finish_reason=event["finish_reason"],
                                    usage=rtx_pb2.Usage(**event["usage"]), logprobs=logprobs, event_id=seq)


def prompt_from(request: rtx_pb2.GenerateRequest) -> str | list[int]:
    match request.WhichOneof("prompt"):
        case "text":
            return request.text
        case "token_ids":
            return list(request.token_ids.ids)
    raise InvalidRequestError("prompt is required: set text or token_ids", param="prompt")


def sampling_params_from(request: rtx_pb2.GenerateRequest) -> SamplingParams:
    fields = {name: getattr(request, name) for name in OPTIONAL_SAMPLING_FIELDS if request.HasField(name)}
    return SamplingParams(stop=list(request.stop), stop_token_ids=list(request.stop_token_ids),
                          ignore_eos=request.ignore_eos, include_stop_str_in_output=request.include_stop_str_in_output,
                          logit_bias=dict(request.logit_bias) or None,
                          allowed_token_ids=list(request.allowed_token_ids.ids)
                          if request.HasField("allowed_token_ids") else None,
                          banned_token_ids=list(request.banned_token_ids) or None,
                          structured_output=_structured_output(request),
                          logits_processors={name: _json_arg(f"logits_processors[{name!r}]", text, "logits_processors")
                                             for name, text in request.logits_processors.items()},
                          **fields)


def _structured_output(request: rtx_pb2.GenerateRequest) -> dict[str, Any] | None:
    """SamplingParams.structured_output from the request's oneof (None when unset)."""
    kind = request.WhichOneof("structured_output")
    match kind:
        case None:
            return None
        case "json_schema":
            return {"json": _json_arg("json_schema", request.json_schema)}
        case "json_object":
            return {"json_object": True} if request.json_object else None
        case "choice":
            return {"choice": list(request.choice.items)}
    return {kind: getattr(request, kind)}  # regex, grammar: text as it is


def _json_arg(what: str, text: str, param: str | None = None) -> Any:
    """``text`` read as JSON; refusals name ``what`` and blame the field ``param`` (``what`` itself by default)."""
    param = param or what
    try:
        return strict_json.loads(text)
    except strict_json.NotJSONNumber as exc:
        raise InvalidRequestError(f"{what} must be JSON text: {exc.args[0]} is not a JSON number",
                                  param=param) from None
    except json.JSONDecodeError as exc:
        raise InvalidRequestError(f"{what} must be JSON text: {exc}", param=param) from None
    except RecursionError:  # nested deeper than Python's parser goes (HTTP's read_json answers the same way)
        raise InvalidRequestError(f"{what} is JSON nested too deeply", param=param) from None


def speculation_from(request: rtx_pb2.GenerateRequest) -> Speculation:
    # An empty repeated field is "no prediction"; proto3 cannot tell it from an empty list, nor needs to.
    return Speculation(list(request.draft_token_ids) or None,
                       request.speculative if request.HasField("speculative") else True)


def response_from_output(out: RequestOutput, request_id: str) -> rtx_pb2.GenerateResponse:
    usage = rtx_pb2.Usage(prompt_tokens=out.num_prompt_tokens, completion_tokens=out.num_output_tokens,
                          cached_tokens=out.num_cached_tokens)
    logprobs = [rtx_pb2.TokenLogprob(token_id=lp.token_id, logprob=lp.logprob,
                                     top=[rtx_pb2.TopLogprob(token_id=t, logprob=p) for t, p in lp.top])
                for lp in out.logprobs or ()]
    return rtx_pb2.GenerateResponse(request_id=request_id, text=out.new_text, token_ids=out.new_token_ids,
                                    finished=out.finished, finish_reason=out.finish_reason or "", usage=usage,
                                    logprobs=logprobs)
