"""The engine core: requests flow scheduler -> backend -> sampler -> output processor, one step at a time.

:meth:`EngineCore.step` is chosen once, at start: the serial step (schedule, execute, sample, update), or on an
accelerator the overlapped one (:mod:`rtxcore.engine.overlap`), which launches step N+1 before it reads step N's
tokens. Requests come in already checked (:mod:`rtxcore.engine.input_processor`); offline use goes through the
facade :class:`rtxcore.engine.llm.LLM`, serving through :class:`rtxcore.engine.async_engine.AsyncEngine`.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable, Sequence

import torch

from rtxcore.capacity.step_time import StepTimeRecorder
from rtxcore.contracts.sampler import SamplerOutput
from rtxcore.contracts.scheduler import SchedulerOutput
from rtxcore.engine.batch_builder import StepPlan, build_embedding_batch, build_step
from rtxcore.engine.components import EngineComponents, build_components, steps_overlap
from rtxcore.engine.config import EngineConfig
from rtxcore.engine.faults import StepFaults
from rtxcore.engine.input_processor import InputLimits, InputProcessor
from rtxcore.engine.outputs import RequestFailure, RequestOutput, TokenLogprob
from rtxcore.engine.prompt_scoring import prompt_logprobs
from rtxcore.errors import EngineFailed, InvalidRequestError
from rtxcore.models.source import ModelSource
from rtxcore.registry import PluginRegistry
from rtxcore.request import Request, RequestStatus

Progress = Callable[[int, int], None]
log = logging.getLogger(__name__)


class EngineCore:
    def __init__(self, config: EngineConfig | None = None, *, registry: PluginRegistry | None = None,
                 source: ModelSource | None = None, progress: Progress | None = None):
        self.config = config = config or EngineConfig()
        parts: EngineComponents = build_components(config, registry, source, progress)
        self.registry = parts.registry
        self.source = parts.source
        self.backend = parts.backend
        self.model_config = parts.backend.model_config
        self.tokenizer = parts.tokenizer
        self.max_model_len = parts.max_model_len
        self.kv_tiers = parts.kv_tiers
        self.kv_cache = parts.kv_cache
        self.scheduler = parts.scheduler
        self.sampler = parts.sampler
        self.output_processor = parts.output_processor
        self.speculator = parts.speculator
        self.logits = parts.logits
        self.requests: dict[str, Request] = {}
        self.generators: dict[str, torch.Generator] = {}
        # Set by each step: how long the scheduler holds its waiting work to merge arrivals (0: no hold).
        self.hold_s = 0.0
        # What this engine's steps take under the load it serves, for capacity planning (exported as metrics).
        self.step_times = StepTimeRecorder()
        # Overlap the host's work with the device's (see steps_overlap).
        overlap = steps_overlap(config, self.backend)
        self.overlapped = overlap
        # Chosen once: each variant is its own method, not one method threaded with flags.
        if overlap:
            from rtxcore.engine.overlap import OverlappedSteps

            self._overlap: OverlappedSteps | None = OverlappedSteps(self)
            self._step: Callable[[], list[RequestOutput]] = self._overlap.step
        else:
            self._overlap = None
            self._step = self.step_serial
        self.faults = StepFaults(self)
        # Final outputs of requests that failed during the step (see rtxcore.engine.faults), returned with its own.
        self._failed: list[RequestOutput] = []

    def input_processor(self) -> InputProcessor:
        """A processor checking requests against this engine's vocabulary, context and cache."""
        limits = InputLimits(self.model_config.vocab_size, self.max_model_len,
                             self.kv_cache.num_usable_blocks * self.config.block_size, self.config.block_size)
        return InputProcessor(self.tokenizer, limits, self.source.name, self.logits)

    # -- requests -------------------------------------------------------------------------------------------------

    def add_request(self, req: Request) -> None:
        """Queue a checked request, changing nothing if it is refused.

        :raises InvalidRequestError: its id is in use.
        :raises AdmissionRefused: the scheduler will not take it now.
        """
        if req.req_id in self.requests:
            raise InvalidRequestError(f"request id {req.req_id!r} is already in use", param="request_id")
        params = req.params
        if params.early_exit_threshold is not None and not self.speculator.supports_early_exit():
            raise InvalidRequestError("early_exit_threshold needs a proposer that drafts through the model's first "
                                      "layers (rtx serve --speculative layer-skip)", param="early_exit_threshold")
        if params.early_exit_threshold is not None and params.logprobs is not None:
            # An early-exited token is the draft's, while the logprobs a step computes are the full model's.
            raise InvalidRequestError("early_exit_threshold cannot be combined with logprobs",
                                      param="early_exit_threshold")
        generator = None
        if params.seed is not None:
            generator = torch.Generator(device=self.backend.device).manual_seed(
                resumed_seed(params.seed, req.num_output_tokens))
        req.arrival_time = time.monotonic()  # when the engine took it (it may have been made on another thread)
        self.scheduler.add_request(req)  # the last step that may refuse: a refusal must leave nothing behind
        if generator is not None:
            self.generators[req.req_id] = generator
        self.requests[req.req_id] = req
        self.output_processor.add(req)
        self.logits.on_add(req)  # first: the speculator asks the request's grammar what it forces
        self.speculator.on_add(req, self.scheduler.num_running)
        if self._overlap is not None:
            self._overlap.on_add(req)

    def abort(self, req_id: str) -> RequestOutput | None:
        """End a request now; returns its final output, or None if it is not here (finished already)."""
        req = self.requests.get(req_id)
        if req is None:
            return None
        req.status = RequestStatus.FINISHED_ABORTED
        self.finish(req)
        return self.output_processor.make_output(req, [], "")

    def has_unfinished_requests(self) -> bool:
        return (self._overlap is not None and self._overlap.in_flight) or self.scheduler.has_unfinished_requests()

    # -- the loop -------------------------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """One engine step; returns every output it produced, failed requests' last ones included: one output per
        request."""
        outputs = self._step()
        if self._failed:
            outputs = _with_failures(outputs, self._failed)
            self._failed = []
        return outputs

    def schedule(self) -> SchedulerOutput:
        """The scheduler's next step, its time to the last one recorded.

        :raises EngineFailed: the scheduler plugin raised, or its step breaks the token budget. The scheduler holds
            every request's place, so no request can go on without it: the engine stops, naming the plugin.
        """
        name = self.config.scheduler
        try:
            sched = self.scheduler.schedule()
        except Exception as exc:
            raise EngineFailed(f"scheduler plugin {name!r} failed: {type(exc).__name__}: {exc}") from exc
        if not isinstance(sched, SchedulerOutput):
            raise EngineFailed(f"scheduler plugin {name!r} returned {type(sched).__name__}, not a SchedulerOutput")
        budget = self.config.scheduling.max_num_batched_tokens
        if sched.total_num_scheduled_tokens > budget:
            raise EngineFailed(f"scheduler plugin {name!r} scheduled {sched.total_num_scheduled_tokens} tokens, past "
                               f"the step's budget of {budget} (max_num_batched_tokens)")
        self.step_times.observe(time.perf_counter(), sched.total_num_scheduled_tokens, len(sched.scheduled))
        return sched

    def note_idle(self) -> None:
        """The driving loop found nothing to run and waits for work: the last step's time ends now. Without it the
        next schedule, after the wait, would count the wait in that step (a live server at half load learnt
        single-request decodes at 76 ms, twice their 38.5 ms, from the few that ended in a wait of seconds)."""
        self.step_times.observe(time.perf_counter(), 0, 0)

    @torch.inference_mode()
    def step_serial(self) -> list[RequestOutput]:
        self.maintain()
        sched = self.schedule()
        self.hold_s = sched.hold_s
        if sched.is_empty:
            self.hold_s = max(self.hold_s, self.kv_cache.idle_step())
            return []
        self.kv_cache.prepare_step(sched.scheduled)
        plan = build_step(sched, self.kv_cache.block_table, self.config.block_size, self.generators, ())
        logits = self.faults.execute(plan)
        if logits is None or not plan.sampling_reqs:
            return []
        reqs, num_rows, sampled = self.faults.sample(logits, plan, plan.sampling_reqs, plan.num_rows, plan.sampling)
        if sampled is None:
            return []
        if num_rows is None:
            outputs = self.update(reqs, sampled)
        else:  # proposed tokens verified
            outputs = self.speculator.verify(reqs, num_rows, sampled, self.output_processor)
            self._fail_detokenization()
            self._finish_outputs(outputs)
        if self.speculator.active:
            self.faults.each(reqs, "proposer", self.config.speculative.method or "assisted",
                             lambda group: self.speculator.propose(group, self.scheduler.num_running))
        return outputs

    def execute(self, plan: StepPlan) -> torch.Tensor:
        """Run the step's batch through the backend and count its tokens as computed; returns the logits."""
        now = time.monotonic()
        logits = self.backend.execute(plan.batch)
        for req, n in zip(plan.reqs, plan.num_tokens):
            req.num_computed_tokens += n
            if req.first_scheduled_time is None:
                req.first_scheduled_time = now
        return logits

    def update(self, reqs: list[Request], sampled: SamplerOutput) -> list[RequestOutput]:
        """Apply sampled tokens (on the host) to their requests; finished ones leave the engine."""
        outputs = self.output_processor.process(reqs, sampled)
        self._fail_detokenization()
        self._finish_outputs(outputs)
        return outputs

    def _fail_detokenization(self) -> None:
        if self.output_processor.failures:
            for req, failure in self.output_processor.failures:
                self.fail(req, failure)
            self.output_processor.failures.clear()

    def fail(self, req: Request, failure: RequestFailure) -> None:
        """End a request that a plugin failed on, alone: its last output carries the error (finish_reason
        "error"), and the step goes on for the others."""
        if self.requests.get(req.req_id) is not req:
            return  # gone already (a grammar's step can end it before the fault is found)
        # A request whose own arguments could not go on is its client's error, not the server's.
        log.log(logging.WARNING if failure.param is not None else logging.ERROR, "request %s failed: %s", req.req_id,
                failure.describe())
        req.status = RequestStatus.FINISHED_ERROR
        out = self.output_processor.make_output(req, [], "")
        out.error = failure
        self.finish(req)
        self._failed.append(out)

    def _finish_outputs(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            if out.finished:
                self.finish(self.requests[out.req_id])

    def finish(self, req: Request) -> None:
        """Forget a request that finished or was aborted; the scheduler hears of it exactly once."""
        held = self._overlap.on_finish(req) if self._overlap is not None else True
        if held:
            self.scheduler.finish_request(req)
        self.output_processor.remove(req.req_id)
        self.speculator.on_finish(req)
        self.logits.on_finish(req)
        self.generators.pop(req.req_id, None)
        del self.requests[req.req_id]

    def maintain(self) -> None:
        """Time-driven upkeep, called by every step and by an idle engine's loop: the periodic KV snapshot (so a
        burst followed by quiet is still saved)."""
        if self.kv_tiers is not None and self.kv_tiers.snapshot_due(time.monotonic()):
            self.save_kv_snapshot()

    def save_kv_snapshot(self) -> int:
        """Write the prefix cache to the disk tier so that a restart starts warm (on shutdown, and periodically);
        returns the blocks written. Call it on the engine's thread, between steps."""
        return self.kv_tiers.save_snapshot(self.kv_cache) if self.kv_tiers is not None else 0

    @torch.inference_mode()
    def embed(self, token_lists: Sequence[list[int]]) -> list[list[float]]:
        """Normalized mean-pooled final hidden states of each input (checked by the input processor), computed
        without touching the KV cache."""
        vectors: list[list[float]] = []
        for group in token_groups(token_lists, self.config.scheduling.max_num_batched_tokens):
            hidden = self.backend.embed(build_embedding_batch(group, self.config.block_size))
            starts = itertools.accumulate((len(ids) for ids in group), initial=0)
            for start, ids in zip(starts, group):
                pooled = hidden[start:start + len(ids)].mean(dim=0)
                vectors.append(torch.nn.functional.normalize(pooled, dim=0).tolist())
        return vectors

    def prompt_logprobs(self, token_lists: Sequence[list[int]], num_top: int) -> list[list[TokenLogprob | None]]:
        """Each prompt token's log-probability given those before it (None for the first), with ``num_top``
        alternatives; computed without touching the KV cache (rtxcore.engine.prompt_scoring)."""
        return prompt_logprobs(self.backend, token_lists, num_top, self.config.block_size)


def _with_failures(outputs: list[RequestOutput], failed: list[RequestOutput]) -> list[RequestOutput]:
    """The step's outputs with the failed requests' last ones. A request that failed after the step gave it a token
    (a proposer failing on the next proposal) has both: its token goes into its last output, which ends it, so that
    no one sees an unfinished output of a request that is gone."""
    last = {out.req_id: out for out in failed}
    merged = []
    for out in outputs:
        final = last.get(out.req_id)
        if final is None:
            merged.append(out)
            continue
        final.new_token_ids = out.new_token_ids + final.new_token_ids
        final.new_text = out.new_text + final.new_text
        if out.logprobs is not None:
            final.logprobs = out.logprobs + (final.logprobs or [])
    return merged + failed


def resumed_seed(seed: int, num_output_tokens: int) -> int:
    """The generator seed of a request resumed after ``num_output_tokens`` tokens. The state its generator had
    reached is lost with the process, so the same seed would replay the draws of the first tokens; a seed derived
    from both keeps a resumed run reproducible from the journal (a fresh request is seeded with ``seed`` itself)."""
    if num_output_tokens == 0:
        return seed
    return (seed * 1_000_003 + num_output_tokens) % 2**63


def token_groups(token_lists: Sequence[list[int]], budget: int) -> list[list[list[int]]]:
    """``token_lists`` in order, in groups of at most ``budget`` tokens (an input longer than that alone)."""
    groups: list[list[list[int]]] = []
    size = 0
    for ids in token_lists:
        if groups and size + len(ids) > budget:
            groups.append([])
            size = 0
        if not groups:
            groups.append([])
        groups[-1].append(ids)
        size += len(ids)
    return groups
