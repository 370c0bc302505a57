"""Apply sampled tokens to their requests: detokenize, check stop conditions, build the step's outputs."""

from __future__ import annotations

import time

import torch

from rtxcore.contracts.sampler import SamplerOutput
from rtxcore.engine.outputs import (
    LOGPROB_FLOOR,
    NO_TOKEN,
    RequestFailure,
    RequestOutput,
    RequestTimings,
    TokenLogprob,
)
from rtxcore.request import Request, RequestStatus
from rtxcore.tokenizer import IncrementalDetokenizer, Tokenizer


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer | None, eos_token_ids: list[int], max_model_len: int):
        self.tokenizer = tokenizer
        self.eos_token_ids = set(eos_token_ids)
        self.max_model_len = max_model_len
        self._detokenizers: dict[str, IncrementalDetokenizer] = {}
        # Requests whose token could not be applied (the detokenizer raised on it), for the engine to fail alone.
        self.failures: list[tuple[Request, RequestFailure]] = []

    def add(self, req: Request) -> None:
        """Track a new request; one resumed with output tokens (from a journal) has its detokenizer caught up with
        them, so that its next text delta starts where the last one sent before the restart ended."""
        if self.tokenizer is not None:
            p = req.params
            detok = IncrementalDetokenizer(
                self.tokenizer, req.prompt_token_ids, stop=p.stop,
                include_stop_str_in_output=p.include_stop_str_in_output, skip_special_tokens=p.skip_special_tokens,
                min_tokens=p.min_tokens)
            # One token at a time, as they were generated: the text held back (an incomplete character, the start
            # of a possible stop string) is then exactly what was held back when they were streamed.
            for token in req.output_token_ids:
                detok.update([token])
            self._detokenizers[req.req_id] = detok

    def remove(self, req_id: str) -> None:
        self._detokenizers.pop(req_id, None)

    def process(self, reqs: list[Request], out: SamplerOutput) -> list[RequestOutput]:
        """:param reqs: the requests that sampled, in logits-row order (the step's only host sync happens here)."""
        token_ids = out.token_ids.tolist()
        return self.apply(reqs, token_ids, self.row_logprobs(reqs, token_ids, out))

    def row_logprobs(self, reqs: list[Request], token_ids: list[int], out: SamplerOutput
                     ) -> list[list[TokenLogprob] | None] | None:
        """Each row's logprobs as its request asked for them (``reqs``: the request of each row), or None when no
        row asked."""
        return self._logprobs(reqs, token_ids, out) if out.logprobs is not None else None

    def apply(self, reqs: list[Request], token_ids: list[int],
              logprobs: list[list[TokenLogprob] | None] | None) -> list[RequestOutput]:
        """Append one token to each request (host values), check its stop conditions and build its output."""
        now = time.monotonic()
        eos_token_ids, max_model_len, detokenizers = self.eos_token_ids, self.max_model_len, self._detokenizers
        outputs = []
        # Runs for every request every step: plain attribute reads, and only the work a request asked for.
        for row, (req, token) in enumerate(zip(reqs, token_ids)):
            if token == NO_TOKEN:
                self.failures.append((req, _nothing_to_sample(req)))
                continue
            try:
                all_token_ids = req.all_token_ids
                all_token_ids.append(token)
                num_output_tokens = len(all_token_ids) - len(req.prompt_token_ids)
                if req.first_token_time is None:
                    req.first_token_time = now
                p = req.params
                detok = detokenizers.get(req.req_id) if detokenizers else None
                text = ""
                status: RequestStatus | None = None
                stop_reason: str | int | None = None
                # Within the first min_tokens these are drawn only where nothing else was left to draw (another
                # processor allows only them, a grammar is complete): then they end the request all the same.
                if token in p.stop_token_ids:
                    status, stop_reason = RequestStatus.FINISHED_STOPPED, token
                elif not p.ignore_eos and token in eos_token_ids:
                    status = RequestStatus.FINISHED_STOPPED
                else:
                    if detok is not None:
                        text = detok.update([token])
                        if detok.finished_by_stop:
                            status, stop_reason = RequestStatus.FINISHED_STOPPED, detok.stop_reason
                    if status is None and (num_output_tokens >= p.max_tokens
                                           or len(all_token_ids) + req.num_pending_tokens >= max_model_len):
                        status = RequestStatus.FINISHED_LENGTH
                token_logprobs = logprobs[row] if logprobs is not None else None
                if status is not None:
                    req.status = status
                    req.finish_time = time.monotonic()
                    if detok is not None and not detok.finished_by_stop:
                        text += detok.flush()
                    outputs.append(self.make_output(req, [token], text, token_logprobs, stop_reason))
                else:
                    # What make_output gives a running request, built directly and with positional arguments: matching
                    # keywords takes as long as the rest of this loop's body.
                    outputs.append(RequestOutput(
                        req.req_id, [token], text,
                        False, None, None,  # finished, finish_reason, stop_reason
                        token_logprobs, len(req.prompt_token_ids), num_output_tokens, req.num_cached_tokens,
                    ))
            except Exception as exc:  # this request alone fails (rtxcore.engine.faults); the loop goes on
                self.failures.append((req, RequestFailure("detokenizer", "tokenizer", f"{type(exc).__name__}: {exc}")))
        return outputs

    @staticmethod
    def _logprobs(reqs: list[Request], token_ids: list[int], out: SamplerOutput) -> list[list[TokenLogprob] | None]:
        """Each row's chosen-token logprob and its top alternatives, trimmed to what its request asked for."""
        # The caller checked logprobs; a sampler fills the top alternatives whenever it fills logprobs (a row asking
        # for logprobs asks for its top n, n >= 0; see SamplerOutput).
        assert out.logprobs is not None and out.top_token_ids is not None and out.top_logprobs is not None
        chosen_lp = reportable_logprobs(out.logprobs)
        top_ids, top_lps = out.top_token_ids.tolist(), reportable_logprobs(out.top_logprobs)
        rows: list[list[TokenLogprob] | None] = []
        for row, (req, token) in enumerate(zip(reqs, token_ids)):
            n = req.params.logprobs
            rows.append(None if n is None else
                        [TokenLogprob(token, chosen_lp[row], list(zip(top_ids[row][:n], top_lps[row][:n])))])
        return rows

    def make_output(self, req: Request, new_token_ids: list[int], text: str,
                    logprobs: list[TokenLogprob] | None = None, stop_reason: str | int | None = None) -> RequestOutput:
        finished = req.status.finished
        timings = None
        if finished:
            if req.finish_time is None:  # aborted: nothing else stamps it
                req.finish_time = time.monotonic()
            timings = RequestTimings(req.arrival_time, req.first_scheduled_time, req.first_token_time,
                                     req.finish_time, req.num_preemptions)
        return RequestOutput(
            req_id=req.req_id,
            new_token_ids=new_token_ids,
            new_text=text,
            finished=finished,
            finish_reason=req.status.value if finished else None,
            stop_reason=stop_reason,
            logprobs=logprobs,
            num_prompt_tokens=req.num_prompt_tokens,
            num_output_tokens=req.num_output_tokens,
            num_cached_tokens=req.num_cached_tokens,
            timings=timings,
            num_accepted_prediction_tokens=req.num_accepted_draft_tokens,
            num_rejected_prediction_tokens=req.num_rejected_draft_tokens,
        )


def _nothing_to_sample(req: Request) -> RequestFailure:
    names = ", ".join(req.logits.states) if req.logits is not None and req.logits.states else ""
    if names:
        return RequestFailure("logits_processor", names, "the logits processors left no token to sample (every "
                              "logit of the row was -inf or NaN)")
    return RequestFailure("backend", "model", "the model's logits for this request were all NaN")


def reportable_logprobs(values: torch.Tensor) -> list:
    """``values.tolist()`` with -inf (a token a processor forbids) and NaN (a row left nothing to sample) raised to
    :data:`LOGPROB_FLOOR`."""
    return values.nan_to_num(nan=LOGPROB_FLOOR, neginf=LOGPROB_FLOOR).clamp_(min=LOGPROB_FLOOR).tolist()
