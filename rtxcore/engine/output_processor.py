"""Apply sampled tokens to their requests: detokenize, check stop conditions, build the step's outputs."""

from __future__ import annotations

import time

from rtxcore.contracts.sampler import SamplerOutput
from rtxcore.engine.outputs import RequestOutput, RequestTimings, TokenLogprob
from rtxcore.request import Request, RequestStatus
from rtxcore.tokenizer import IncrementalDetokenizer, Tokenizer


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer | None, eos_token_ids: list[int], max_model_len: int):
        self.tokenizer = tokenizer
        self.eos_token_ids = set(eos_token_ids)
        self.max_model_len = max_model_len
        self._detokenizers: dict[str, IncrementalDetokenizer] = {}

    def add(self, req: Request) -> None:
        if self.tokenizer is not None:
            p = req.params
            self._detokenizers[req.req_id] = IncrementalDetokenizer(
                self.tokenizer, req.prompt_token_ids, stop=p.stop,
                include_stop_str_in_output=p.include_stop_str_in_output, skip_special_tokens=p.skip_special_tokens)

    def remove(self, req_id: str) -> None:
        self._detokenizers.pop(req_id, None)

    def process(self, reqs: list[Request], out: SamplerOutput) -> list[RequestOutput]:
        """:param reqs: the requests that sampled, in logits-row order (the step's only host sync happens here)."""
        token_ids = out.token_ids.tolist()
        want_logprobs = out.logprobs is not None
        if want_logprobs:
            chosen_lp = out.logprobs.tolist()
            top_ids, top_lps = out.top_token_ids.tolist(), out.top_logprobs.tolist()
        now = time.monotonic()
        outputs = []
        for row, (req, token) in enumerate(zip(reqs, token_ids)):
            req.all_token_ids.append(token)
            if req.first_token_time is None:
                req.first_token_time = now
            logprobs = None
            if want_logprobs and req.params.logprobs is not None:
                n = req.params.logprobs
                logprobs = [TokenLogprob(token, chosen_lp[row], list(zip(top_ids[row][:n], top_lps[row][:n])))]
            outputs.append(self._advance(req, token, logprobs))
        return outputs

    def _advance(self, req: Request, token: int, logprobs: list[TokenLogprob] | None) -> RequestOutput:
        p = req.params
        detok = self._detokenizers.get(req.req_id)
        text = ""
        stop_reason: str | int | None = None
        if token in p.stop_token_ids:
            req.status, stop_reason = RequestStatus.FINISHED_STOPPED, token
        elif not p.ignore_eos and token in self.eos_token_ids:
            req.status = RequestStatus.FINISHED_STOPPED
        else:
            if detok is not None:
                text = detok.update([token])
                if detok.finished_by_stop:
                    req.status, stop_reason = RequestStatus.FINISHED_STOPPED, detok.stop_reason
            if not req.is_finished and (req.num_output_tokens >= p.max_tokens or req.num_tokens >= self.max_model_len):
                req.status = RequestStatus.FINISHED_LENGTH
        if req.is_finished:
            req.finish_time = time.monotonic()
            if detok is not None and not detok.finished_by_stop:
                text += detok.flush()
        return self.make_output(req, [token], text, logprobs, stop_reason)

    def make_output(self, req: Request, new_token_ids: list[int], text: str,
                    logprobs: list[TokenLogprob] | None = None, stop_reason: str | int | None = None) -> RequestOutput:
        timings = None
        if req.is_finished:
            if req.finish_time is None:  # aborted: nothing else stamps it
                req.finish_time = time.monotonic()
            timings = RequestTimings(req.arrival_time, req.first_scheduled_time, req.first_token_time,
                                     req.finish_time, req.num_preemptions)
        return RequestOutput(
            req_id=req.req_id,
            new_token_ids=new_token_ids,
            new_text=text,
            finished=req.is_finished,
            finish_reason=req.status.value if req.is_finished else None,
            stop_reason=stop_reason,
            logprobs=logprobs,
            num_prompt_tokens=req.num_prompt_tokens,
            num_output_tokens=req.num_output_tokens,
            num_cached_tokens=req.num_cached_tokens,
            timings=timings,
        )
