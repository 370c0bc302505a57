"""The engine: requests flow scheduler -> backend -> sampler -> detokenizer -> outputs, one step at a time."""

from __future__ import annotations

import itertools
import time
from typing import Callable, Iterator, Sequence

import torch

from rtxcore.contracts.backend import BackendOptions, ExecutionBackend, runs_quantization
from rtxcore.contracts.sampler import SamplerOutput
from rtxcore.engine.batch_builder import build_embedding_batch, build_step
from rtxcore.engine.config import EngineConfig
from rtxcore.engine.in_flight import InFlightStep, select_rows
from rtxcore.engine.kv_tiers import KVTiers
from rtxcore.engine.output_processor import OutputProcessor
from rtxcore.engine.outputs import CompletionResult, RequestOutput
from rtxcore.errors import CapacityError, ConfigError, InvalidRequestError, PluginError
from rtxcore.kv.manager import KVCacheManager
from rtxcore.lanes import DEFAULT_LANE, check_lane_name
from rtxcore.models.source import ModelSource, resolve_model
from rtxcore.registry import PluginRegistry, load_plugins
from rtxcore.request import Request, RequestStatus
from rtxcore.sampling_params import SamplingParams
from rtxcore.transfer import to_device, to_device_async

Prompt = str | Sequence[int]


class LLMEngine:
    def __init__(self, config: EngineConfig | None = None, *, registry: PluginRegistry | None = None,
                 source: ModelSource | None = None, progress: Callable[[int, int], None] | None = None):
        self.config = config = config or EngineConfig()
        # Plugins are resolved once here; nothing on the per-token path goes through the plugin manager.
        self.registry = registry or load_plugins()
        self.source = source or resolve_model(config.model)
        self.backend = self._make_backend()
        self.backend.load(self.source, progress=progress)
        self.model_config = self.backend.model_config
        self.tokenizer = self.source.tokenizer()
        self.max_model_len = min(config.max_model_len or self.model_config.max_position, self.model_config.max_position)

        num_blocks = config.num_kv_blocks or self._num_blocks_from_memory()
        policy = self.registry.create("eviction_policy", config.eviction_policy, num_blocks)
        self.backend.allocate_kv_cache(num_blocks, config.block_size)
        # Host-memory and disk tiers under the device's prefix cache, when configured.
        self.kv_tiers = (KVTiers(config, self.backend, self.registry, self.source)
                         if config.kv_host_bytes or config.kv_disk_dir else None)
        self.kv_cache = KVCacheManager(num_blocks, config.block_size, policy, config.enable_prefix_caching,
                                       self.kv_tiers.offload if self.kv_tiers is not None else None)
        if self.kv_tiers is not None:
            self.kv_tiers.load_snapshot()
        self.scheduler = self.registry.create("scheduler", config.scheduler, config.scheduling, self.kv_cache)
        self.sampler = self.registry.create("sampler", config.sampler)
        eos = self.tokenizer.eos_token_ids if self.tokenizer is not None else self.model_config.eos_token_ids
        self.output_processor = OutputProcessor(self.tokenizer, list(eos), self.max_model_len)
        self.requests: dict[str, Request] = {}
        self._generators: dict[str, torch.Generator] = {}
        # Overlap the host's work with the device's: on by default where the model runs on an accelerator.
        self._async = config.async_scheduling if config.async_scheduling is not None else (
            self.backend.device.type != "cpu")
        self._in_flight: InFlightStep | None = None
        # Running requests whose sampling needs all earlier tokens on the host (see SamplingParams).
        self._num_history_reqs = 0
        self._ids = itertools.count()
        # Set by each step: how long the scheduler holds its waiting work to merge arrivals (0: no hold).
        self.hold_s = 0.0

    def _make_backend(self) -> ExecutionBackend:
        record = self.registry.get("backend", self.config.backend)
        caps = record.cls.capabilities()
        if not caps.available:
            raise PluginError(f"backend {self.config.backend!r} is unavailable: {caps.unavailable_reason}")
        methods = self.source.quantization_methods()
        if self.config.quantization and methods:
            raise ConfigError(f"{self.source.name} is already quantized ({', '.join(methods)}): drop --quantization")
        quantizers = {}
        for method in (*methods, *([self.config.quantization] if self.config.quantization else [])):
            quantizers[method] = self.registry.create("quantizer", method)
            if not runs_quantization(caps, method):
                raise PluginError(f"backend {self.config.backend!r} cannot run {method!r} weights (it accepts: "
                                  f"{', '.join(caps.quantization_formats) or 'none'})")
        c = self.config
        quantizer = quantizers.get(c.quantization) if c.quantization else None
        return self.registry.create(
            "backend", self.config.backend,
            BackendOptions(c.device, c.dtype, quantizer, max_batch_size=c.scheduling.max_num_seqs,
                           max_model_len=c.max_model_len, enforce_eager=c.enforce_eager,
                           verify_artifact=c.verify_artifact, quantizers=quantizers))

    def _num_blocks_from_memory(self) -> int:
        budget = self.config.kv_cache_bytes or self.backend.available_kv_cache_bytes()
        per_block = self.backend.kv_cache_bytes_per_token() * self.config.block_size
        # No point holding more than every sequence at full length could use.
        most = self.config.scheduling.max_num_seqs * -(-self.max_model_len // self.config.block_size) + 1
        return max(2, min(budget // per_block, most))

    # -- requests -------------------------------------------------------------------------------------------------

    def add_request(self, prompt: Prompt, params: SamplingParams | None = None, req_id: str | None = None,
                    cache_salt: str | None = None, lane: str = DEFAULT_LANE, tenant: str | None = None,
                    output_token_ids: Sequence[int] = ()) -> str:
        """Validate and queue a request, changing nothing if it fails.

        :param output_token_ids: tokens this request already produced (a request resumed from the journal after a
            restart): prefilled after the prompt and counted against ``params.max_tokens``, so generation goes on
            where it stopped.
        :raises InvalidRequestError: naming the problem.
        :raises AdmissionRefused: the scheduler will not take it now.
        """
        params = params or SamplingParams()
        check_lane_name(lane)
        token_ids = self.encode(prompt)
        output_token_ids = self._check_resumed_outputs(output_token_ids, params)
        req_id = req_id if req_id is not None else f"req-{next(self._ids)}"
        if req_id in self.requests:
            raise InvalidRequestError(f"request id {req_id!r} is already in use", param="request_id")
        total = len(token_ids) + params.max_tokens
        if len(token_ids) >= self.max_model_len:
            raise CapacityError(f"prompt is {len(token_ids)} tokens, longer than the model's context of "
                                f"{self.max_model_len} tokens (at least one must be left to generate)", param="prompt")
        if total > self.max_model_len:
            raise CapacityError(f"prompt ({len(token_ids)} tokens) plus max_tokens ({params.max_tokens}) is {total}, "
                                f"more than the model's context of {self.max_model_len} tokens", param="max_tokens")
        if self.kv_cache.blocks_needed(total) > self.kv_cache.num_usable_blocks:
            raise CapacityError(f"request needs up to {total} tokens of KV cache but the whole cache holds "
                                f"{self.kv_cache.num_usable_blocks * self.config.block_size}", param="max_tokens")
        req = Request(req_id, token_ids, params, all_token_ids=token_ids + output_token_ids, cache_salt=cache_salt,
                      lane=lane, tenant=tenant)
        generator = None
        if params.seed is not None:
            generator = torch.Generator(device=self.backend.device).manual_seed(
                _resumed_seed(params.seed, len(output_token_ids)))
        self.scheduler.add_request(req)  # the last step that may refuse: a refusal must leave nothing behind
        if params.needs_output_history:
            self._num_history_reqs += 1
        if generator is not None:
            self._generators[req_id] = generator
        self.requests[req_id] = req
        self.output_processor.add(req)
        return req_id

    def _check_resumed_outputs(self, output_token_ids: Sequence[int], params: SamplingParams) -> list[int]:
        output_token_ids = self._check_token_ids(output_token_ids, "output token ids", "output_token_ids")
        if len(output_token_ids) >= params.max_tokens:
            raise InvalidRequestError(f"{len(output_token_ids)} output tokens already reach max_tokens "
                                      f"({params.max_tokens}): nothing is left to generate", param="output_token_ids")
        return output_token_ids

    def encode(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidRequestError("prompt is empty", param="prompt")
            if self.tokenizer is None:
                raise InvalidRequestError(f"model {self.source.name} has no tokenizer: give the prompt as token ids",
                                          param="prompt")
            token_ids = self.tokenizer.encode(prompt)
        else:
            token_ids = self._check_token_ids(prompt, "prompt token ids", "prompt")
        if not token_ids:
            raise InvalidRequestError("prompt is empty", param="prompt")
        return token_ids

    def _check_token_ids(self, token_ids: Sequence[int], what: str, param: str) -> list[int]:
        token_ids = list(token_ids)
        vocab = self.model_config.vocab_size
        bad = [t for t in token_ids if not isinstance(t, int) or not 0 <= t < vocab]
        if bad:
            raise InvalidRequestError(f"{what} must be integers in [0, {vocab}); got {bad[0]!r}", param=param)
        return token_ids

    def apply_chat_template(self, messages: list[dict[str, str]]) -> str:
        if self.tokenizer is None:
            raise InvalidRequestError(f"model {self.source.name} has no tokenizer and no chat template")
        return self.tokenizer.apply_chat_template(messages, add_generation_prompt=True)

    def abort(self, req_id: str) -> RequestOutput | None:
        req = self.requests.get(req_id)
        if req is None:
            return None
        req.status = RequestStatus.FINISHED_ABORTED
        return self._finish(req, [], "")

    def has_unfinished_requests(self) -> bool:
        return self._in_flight is not None or self.scheduler.has_unfinished_requests()

    # -- the loop -------------------------------------------------------------------------------------------------

    @torch.inference_mode()
    def step(self) -> list[RequestOutput]:
        """Run one step. With asynchronous scheduling the step's sampled tokens stay on the device: the next call
        feeds them to the model and, while the device computes, returns their outputs."""
        prev, self._in_flight = self._in_flight, None
        outputs: list[RequestOutput] = []
        if prev is not None and self._num_history_reqs:
            # Penalties need every earlier token on the host before sampling: no overlap this step.
            outputs, prev = self._process(prev), None
        self.maintain()
        sched = self.scheduler.schedule()
        self.hold_s = sched.hold_s
        if sched.is_empty:
            return outputs + (self._process(prev) if prev is not None else [])
        plan = build_step(sched, self.kv_cache.block_table, self.config.block_size, self._generators,
                          prev.reqs if prev is not None else ())
        if plan.pending_rows:
            plan.batch.input_ids = self._fill_pending(plan, prev.token_ids)
        now = time.monotonic()
        logits = self.backend.execute(plan.batch)
        for req, n in zip(plan.reqs, plan.num_tokens):
            req.num_computed_tokens += n
            if req.first_scheduled_time is None:
                req.first_scheduled_time = now
        if plan.sampling_reqs:
            sampled = self.sampler.sample(logits, plan.sampling)
            if self._async:
                self._in_flight = self._launch(plan.sampling_reqs, sampled)
            else:
                outputs += self._apply(plan.sampling_reqs, sampled)
        if prev is not None:
            outputs += self._process(prev)
        return outputs

    def maintain(self) -> None:
        """Time-driven upkeep, called by every step and by an idle engine's loop: the periodic KV snapshot (so a
        burst followed by quiet is still saved)."""
        if self.kv_tiers is not None and self.kv_tiers.snapshot_due(time.monotonic()):
            self.save_kv_snapshot()

    def save_kv_snapshot(self) -> int:
        """Write the prefix cache to the disk tier so that a restart starts warm (on shutdown, and periodically);
        returns the blocks written. Call it on the engine's thread, between steps."""
        return self.kv_tiers.save_snapshot(self.kv_cache) if self.kv_tiers is not None else 0

    def _fill_pending(self, plan, prev_token_ids: torch.Tensor) -> torch.Tensor:
        """The step's input ids on the device, with each not-yet-read token taken from the previous step's samples."""
        device = prev_token_ids.device
        host_ids = plan.batch.input_ids
        k = len(plan.pending_rows)
        if plan.pending_rows == plan.pending_src and plan.pending_rows[-1] == k - 1:
            # The same requests in the same order as the last step. In the usual decode step every row is pending:
            # the previous samples are then the whole input, used where they are (no copy, nothing pinned); with
            # more rows, a slice copy does, without sending index lists to the device.
            if k == len(host_ids) and prev_token_ids.dtype == host_ids.dtype:
                return prev_token_ids[:k]
            ids = to_device_async(host_ids, device)
            ids[:k] = prev_token_ids[:k]
            return ids
        ids = to_device_async(host_ids, device)
        # Destination rows and source rows in one tensor: one copy to the device instead of two.
        index = to_device(plan.pending_rows + plan.pending_src, torch.long, device)
        ids[index[:k]] = prev_token_ids[index[k:]]
        return ids

    def _launch(self, reqs: list[Request], sampled: SamplerOutput) -> InFlightStep:
        """Leave the sampled tokens on the device and queue their copy to the host; the requests count them as
        pending until the copy is read."""
        max_model_len = self.max_model_len
        for req in reqs:
            req.num_pending_tokens += 1
            # Its last token is certain now, whatever its value: stop scheduling it (its KV may be reused after
            # this step, which the device runs first). num_tokens and its outputs written out: a property call
            # costs as much as the test, and this runs for every request every step.
            num_tokens = len(req.all_token_ids) + req.num_pending_tokens
            if num_tokens - len(req.prompt_token_ids) >= req.params.max_tokens or num_tokens >= max_model_len:
                self.scheduler.finish_request(req)
        return InFlightStep.launch(reqs, sampled)

    def _process(self, step: InFlightStep) -> list[RequestOutput]:
        host = step.wait()
        reqs, requests = step.reqs, self.requests
        for req in reqs:
            req.num_pending_tokens -= 1
        # Requests that finished or were aborted since the step launched drop their token. Usually none did: then
        # the rows stay as they are, with no second list built.
        live = [requests.get(req.req_id) is req for req in reqs]
        if all(live):
            return self._apply(reqs, host)
        rows = list(itertools.compress(range(len(reqs)), live))
        return self._apply([reqs[row] for row in rows], select_rows(host, rows))

    def _apply(self, reqs: list[Request], sampled: SamplerOutput) -> list[RequestOutput]:
        outputs = self.output_processor.process(reqs, sampled)
        for out in outputs:
            if out.finished:
                self._finish(self.requests[out.req_id], None, None)
        return outputs

    def _finish(self, req: Request, new_token_ids: list[int] | None, text: str | None) -> RequestOutput | None:
        self.scheduler.finish_request(req)
        if req.params.needs_output_history:
            self._num_history_reqs -= 1
        self.output_processor.remove(req.req_id)
        self._generators.pop(req.req_id, None)
        del self.requests[req.req_id]
        if new_token_ids is None:
            return None
        return self.output_processor.make_output(req, new_token_ids, text)

    @torch.inference_mode()
    def embed(self, inputs: Sequence[Prompt]) -> list[list[float]]:
        """Normalized mean-pooled final hidden states of each input, computed without touching the KV cache."""
        token_lists = [self.encode(x) for x in inputs]
        for ids in token_lists:
            if len(ids) > self.max_model_len:
                raise CapacityError(f"input is {len(ids)} tokens, longer than the model's context of "
                                    f"{self.max_model_len} tokens", param="input")
        vectors: list[list[float]] = []
        for group in _token_groups(token_lists, self.config.scheduling.max_num_batched_tokens):
            hidden = self.backend.embed(build_embedding_batch(group, self.config.block_size))
            starts = itertools.accumulate((len(ids) for ids in group), initial=0)
            for start, ids in zip(starts, group):
                pooled = hidden[start:start + len(ids)].mean(dim=0)
                vectors.append(torch.nn.functional.normalize(pooled, dim=0).tolist())
        return vectors

    # -- offline helpers ------------------------------------------------------------------------------------------

    def generate(self, prompts: Sequence[Prompt], params: SamplingParams | Sequence[SamplingParams] | None = None
                 ) -> list[CompletionResult]:
        """Run prompts to completion with continuous batching; results in prompt order."""
        params_list = list(params) if isinstance(params, Sequence) else [params or SamplingParams()] * len(prompts)
        ids = [self.add_request(p, sp) for p, sp in zip(prompts, params_list)]
        results = {i: CompletionResult(i, self.requests[i].prompt_token_ids, [], "", None) for i in ids}
        while self.has_unfinished_requests():
            for out in self.step():
                _accumulate(results[out.req_id], out)
        return [results[i] for i in ids]

    def stream(self, prompt: Prompt, params: SamplingParams | None = None) -> Iterator[RequestOutput]:
        req_id = self.add_request(prompt, params)
        try:
            while req_id in self.requests:
                for out in self.step():
                    if out.req_id == req_id:
                        yield out
        finally:
            self.abort(req_id)


def _resumed_seed(seed: int, num_output_tokens: int) -> int:
    """The generator seed of a request resumed after ``num_output_tokens`` tokens. The state its generator had
    reached is lost with the process, so the same seed would replay the draws of the first tokens; a seed derived
    from both keeps a resumed run reproducible from the journal (a fresh request is seeded with ``seed`` itself)."""
    if num_output_tokens == 0:
        return seed
    return (seed * 1_000_003 + num_output_tokens) % 2**63


def _token_groups(token_lists: list[list[int]], budget: int) -> Iterator[list[list[int]]]:
    group: list[list[int]] = []
    size = 0
    for ids in token_lists:
        if group and size + len(ids) > budget:
            yield group
            group, size = [], 0
        group.append(ids)
        size += len(ids)
    if group:
        yield group


def _accumulate(result: CompletionResult, out: RequestOutput) -> None:
    result.token_ids.extend(out.new_token_ids)
    result.text += out.new_text
    result.num_cached_tokens = out.num_cached_tokens
    if out.logprobs is not None:
        result.logprobs = (result.logprobs or []) + out.logprobs
    if out.finished:
        result.finish_reason = out.finish_reason
