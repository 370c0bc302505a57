"""The overlapped engine step (asynchronous scheduling): step N+1 is launched before step N's tokens are read.

Sampled tokens stay on the device and their copy to the host is queued behind the sampler (``in_flight``); each
request counts its token as *pending* (``Request.num_pending_tokens``), so the scheduler schedules its next decode
while ``all_token_ids``, block hashes and stop checks see known tokens only. The next step takes its pending inputs
from the previous step's sampled tensor on the device, and while the device computes it the host turns the previous
step's tokens into outputs.
"""

from __future__ import annotations

import itertools
from typing import TYPE_CHECKING

import torch

from rtxcore.contracts.sampler import SamplerOutput
from rtxcore.engine.batch_builder import StepPlan, build_step
from rtxcore.engine.in_flight import InFlightStep, select_rows
from rtxcore.engine.outputs import RequestOutput
from rtxcore.request import Request
from rtxcore.transfer import to_device, to_device_async

if TYPE_CHECKING:
    from rtxcore.engine.core import EngineCore


class OverlappedSteps:
    def __init__(self, core: EngineCore):
        self.core = core
        self._in_flight: InFlightStep | None = None
        # Running requests whose sampling needs all earlier tokens on the host (see SamplingParams): while one runs,
        # steps do not overlap.
        self._num_history_reqs = 0
        # Running requests with a stateful logits processor (a grammar): their masks need the previous step's
        # tokens, which are read after this step's forward pass is launched and before its sampling.
        self._num_stateful_reqs = 0
        # Requests handed back to the scheduler when their last token was launched, before it was read: the
        # scheduler must not hear of them again when they finish.
        self._released: set[str] = set()

    @property
    def in_flight(self) -> bool:
        return self._in_flight is not None

    def on_add(self, req: Request) -> None:
        if req.params.needs_output_history:
            self._num_history_reqs += 1
        if req.logits is not None and req.logits.stateful:
            self._num_stateful_reqs += 1

    def on_finish(self, req: Request) -> bool:
        """A request leaves the engine; returns whether the scheduler still holds it."""
        if req.params.needs_output_history:
            self._num_history_reqs -= 1
        if req.logits is not None and req.logits.stateful:
            self._num_stateful_reqs -= 1
        if req.req_id in self._released:
            self._released.remove(req.req_id)
            return False
        return True

    @torch.inference_mode()
    def step(self) -> list[RequestOutput]:
        """Launch the next step, then return the outputs of the previous one while the device computes."""
        core = self.core
        prev, self._in_flight = self._in_flight, None
        outputs: list[RequestOutput] = []
        if core.speculator.active:
            # Requests with tokens of their own to verify: the previous step's tokens are needed on the host to
            # propose, so this step runs serially.
            if prev is not None:
                outputs = self._process(prev)
            return outputs + core.step_serial()
        if prev is not None and self._num_history_reqs:
            # Penalties need every earlier token on the host before sampling: no overlap this step.
            outputs, prev = self._process(prev), None
        core.maintain()
        sched = core.schedule()
        core.hold_s = sched.hold_s
        if sched.is_empty:
            core.hold_s = max(core.hold_s, core.kv_cache.idle_step())
            return outputs + (self._process(prev) if prev is not None else [])
        core.kv_cache.prepare_step(sched.scheduled)
        plan = build_step(sched, core.kv_cache.block_table, core.config.block_size, core.generators,
                          prev.reqs if prev is not None else ())
        if prev is not None and plan.pending_rows:
            plan.batch.input_ids = self._fill_pending(plan, prev.token_ids)
        logits = core.faults.execute(plan)
        if logits is not None and plan.sampling_reqs:
            if prev is not None and self._num_stateful_reqs:
                # A grammar's mask for this step follows the previous step's tokens: read them now, while the
                # device computes this step's forward pass (queued above), then mask and sample.
                outputs, prev = outputs + self._process(prev), None
            reqs, _, sampled = core.faults.sample(logits, plan, plan.sampling_reqs, None, plan.sampling)
            if sampled is not None:
                # A row marked NO_TOKEN (nothing to sample) still feeds the next step a real id; its request fails
                # when the host reads the mark, and that step's token is dropped.
                inputs = sampled.token_ids.clamp(min=0) if core.logits.active else sampled.token_ids
                self._in_flight = self._launch(reqs, sampled, inputs)
        if prev is not None:
            outputs += self._process(prev)
        return outputs

    def _fill_pending(self, plan: StepPlan, prev_token_ids: torch.Tensor) -> torch.Tensor:
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

    def _launch(self, reqs: list[Request], sampled: SamplerOutput, inputs: torch.Tensor) -> InFlightStep:
        """Leave the sampled tokens on the device and queue their copy to the host; the requests count them as
        pending until the copy is read."""
        core = self.core
        max_model_len, requests = core.max_model_len, core.requests
        for req in reqs:
            req.num_pending_tokens += 1
            if requests.get(req.req_id) is not req:
                # Finished while this step was prepared (a grammar's step reads the previous tokens first): its
                # token is dropped when read, and the scheduler has heard of its end already.
                continue
            # Its last token is certain now, whatever its value: hand it back to the scheduler (its KV may be reused
            # after this step, which the device runs first). num_tokens and its outputs written out: a property call
            # costs as much as the test, and this runs for every request every step.
            num_tokens = len(req.all_token_ids) + req.num_pending_tokens
            if num_tokens - len(req.prompt_token_ids) >= req.params.max_tokens or num_tokens >= max_model_len:
                core.scheduler.finish_request(req)
                self._released.add(req.req_id)
        return InFlightStep.launch(reqs, sampled, inputs)

    def _process(self, step: InFlightStep) -> list[RequestOutput]:
        host = step.wait()
        reqs, requests = step.reqs, self.core.requests
        for req in reqs:
            req.num_pending_tokens -= 1
        # Requests that finished or were aborted since the step launched drop their token. Usually none did: then
        # the rows stay as they are, with no second list built.
        live = [requests.get(req.req_id) is req for req in reqs]
        if all(live):
            return self.core.update(reqs, host)
        rows = list(itertools.compress(range(len(reqs)), live))
        return self.core.update([reqs[row] for row in rows], select_rows(host, rows))

