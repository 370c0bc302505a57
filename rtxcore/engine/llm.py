"""Offline use of the engine in one thread: generate, stream and embed (what a script or a notebook calls).

    llm = LLM(EngineConfig(model="smollm2-135m"))
    [result] = llm.generate(["The capital of France is"], SamplingParams(max_tokens=16))

A facade over :class:`EngineCore` (which steps) and :class:`InputProcessor` (which checks and encodes); servers
drive the same core through :class:`rtxcore.engine.async_engine.AsyncEngine` instead.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator, Sequence

from rtxcore.engine.config import EngineConfig
from rtxcore.engine.core import EngineCore
from rtxcore.engine.input_processor import Prompt
from rtxcore.engine.outputs import CompletionResult, RequestOutput
from rtxcore.lanes import DEFAULT_LANE
from rtxcore.models.source import ModelSource
from rtxcore.registry import PluginRegistry
from rtxcore.sampling_params import SamplingParams


class LLM:
    def __init__(self, config: EngineConfig | None = None, *, registry: PluginRegistry | None = None,
                 source: ModelSource | None = None, progress: Callable[[int, int], None] | None = None):
        self.core = EngineCore(config, registry=registry, source=source, progress=progress)
        self.inputs = self.core.input_processor()
        self._ids = itertools.count()

    @property
    def tokenizer(self):
        return self.core.tokenizer

    def add_request(self, prompt: Prompt, params: SamplingParams | None = None, req_id: str | None = None, *,
                    cache_salt: str | None = None, lane: str = DEFAULT_LANE, tenant: str | None = None,
                    output_token_ids: Sequence[int] = (), draft_token_ids: Sequence[int] | None = None,
                    speculative: bool = True) -> str:
        """Check and queue a request for :meth:`step`; returns its id.

        :raises InvalidRequestError: naming the problem. :raises AdmissionRefused: the scheduler will not take it.
        """
        req = self.inputs.make_request(prompt, params or SamplingParams(),
                                       req_id if req_id is not None else f"req-{next(self._ids)}",
                                       cache_salt=cache_salt, lane=lane, tenant=tenant,
                                       output_token_ids=output_token_ids, draft_token_ids=draft_token_ids,
                                       speculative=speculative)
        self.core.add_request(req)
        return req.req_id

    def step(self) -> list[RequestOutput]:
        return self.core.step()

    def has_unfinished_requests(self) -> bool:
        return self.core.has_unfinished_requests()

    def abort(self, req_id: str) -> RequestOutput | None:
        return self.core.abort(req_id)

    def generate(self, prompts: Sequence[Prompt], params: SamplingParams | Sequence[SamplingParams] | None = None
                 ) -> list[CompletionResult]:
        """Run prompts to completion with continuous batching; results in prompt order."""
        params_list = list(params) if isinstance(params, Sequence) else [params or SamplingParams()] * len(prompts)
        ids = [self.add_request(p, sp) for p, sp in zip(prompts, params_list)]
        requests = self.core.requests
        results = {i: CompletionResult(i, requests[i].prompt_token_ids, [], "", None) for i in ids}
        while self.core.has_unfinished_requests():
            for out in self.core.step():
                _accumulate(results[out.req_id], out)
        return [results[i] for i in ids]

    def stream(self, prompt: Prompt, params: SamplingParams | None = None) -> Iterator[RequestOutput]:
        req_id = self.add_request(prompt, params)
        try:
            while req_id in self.core.requests:
                for out in self.core.step():
                    if out.req_id == req_id:
                        yield out
        finally:
            self.core.abort(req_id)

    def embed(self, inputs: Sequence[Prompt]) -> list[list[float]]:
        """Normalized mean-pooled final hidden states of each input."""
        token_lists = [self.inputs.encode(x) for x in inputs]
        self.inputs.check_embedding_inputs(token_lists)
        return self.core.embed(token_lists)


def _accumulate(result: CompletionResult, out: RequestOutput) -> None:
    result.token_ids.extend(out.new_token_ids)
    result.text += out.new_text
    result.num_cached_tokens = out.num_cached_tokens
    if out.logprobs is not None:
        result.logprobs = (result.logprobs or []) + out.logprobs
    if out.finished:
        result.finish_reason = out.finish_reason
        result.error = out.error
