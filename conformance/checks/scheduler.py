"""The scheduler contract, checked by driving a scheduler as the engine does, over the real KV-cache manager.

The harness plays the engine's part without a model: each step it calls ``schedule()``, checks the output, counts
the scheduled tokens as computed, appends one made-up token to every request whose known tokens are all computed,
and finishes requests at ``max_tokens`` (some are aborted on the way). Token values do not matter to a scheduler.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from rtx_conformance.rules import ContractViolation, build, require
from rtxcore.contracts.eviction import EvictionPolicy
from rtxcore.contracts.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from rtxcore.errors import AdmissionRefused, RtxError
from rtxcore.kv.manager import KVCacheManager
from rtxcore.request import Request, RequestStatus
from rtxcore.sampling_params import SamplingParams

# Longest a scheduler may hold waiting work in a row (merge windows) before that counts as a stall.
MAX_HOLD_S = 1.0


@dataclass(frozen=True, slots=True)
class WorkloadRequest:
    prompt_token_ids: tuple[int, ...]
    max_tokens: int
    # Step at which the request arrives.
    arrival_step: int = 0
    # Step at which it is aborted, if it has not finished by then.
    abort_step: int | None = None


@dataclass(frozen=True, slots=True)
class SchedulerWorkload:
    config: SchedulerConfig
    num_kv_blocks: int
    block_size: int
    requests: tuple[WorkloadRequest, ...]

    def __post_init__(self) -> None:
        # Every request must fit in the cache on its own, or no scheduler could finish it.
        need = max(-(-(len(r.prompt_token_ids) + r.max_tokens) // self.block_size) for r in self.requests)
        if need > self.num_kv_blocks - 1:
            raise ValueError(f"a request needs {need} blocks but the cache has {self.num_kv_blocks - 1}")


class _Candidates(EvictionPolicy):
    """The cache's eviction policy while a scheduler is under test: oldest candidate first, nothing more."""

    def __init__(self, capacity: int):
        super().__init__(capacity)
        self._order: dict[int, None] = {}

    def add(self, block_id: int) -> None:
        self._order[block_id] = None

    def remove(self, block_id: int) -> None:
        del self._order[block_id]

    def evict(self) -> int | None:
        if not self._order:
            return None
        block_id = next(iter(self._order))
        del self._order[block_id]
        return block_id

    def forget(self, block_id: int) -> None:
        self._order.pop(block_id, None)

    def __len__(self) -> int:
        return len(self._order)

    def __contains__(self, block_id: int) -> bool:
        return block_id in self._order


@dataclass(slots=True)
class SchedulerRun:
    """What happened, for figures and for tests of the harness itself."""

    num_steps: int = 0
    num_finished: int = 0
    num_aborted: int = 0
    num_preemptions: int = 0
    # Requests add_request refused (AdmissionRefused), which the harness then forgets.
    num_refused: int = 0
    max_step_tokens: int = 0
    finished_ids: list[str] = field(default_factory=list)


def run_workload(scheduler_cls: type[Scheduler], workload: SchedulerWorkload) -> SchedulerRun:
    """Drive a fresh scheduler through ``workload``; raise :class:`ContractViolation` at the first broken rule."""
    kv = KVCacheManager(workload.num_kv_blocks, workload.block_size, _Candidates(workload.num_kv_blocks), True)
    scheduler = build("scheduler", scheduler_cls, workload.config, kv)
    run = _Harness(scheduler, kv, workload).run()
    require(run.num_finished + run.num_aborted + run.num_refused == len(workload.requests), "scheduler.no_drop",
            f"{len(workload.requests)} requests, but {run.num_finished} finished, {run.num_aborted} aborted and "
            f"{run.num_refused} refused")
    return run


class _Harness:
    def __init__(self, scheduler: Scheduler, kv: KVCacheManager, workload: SchedulerWorkload):
        self.scheduler, self.kv, self.workload = scheduler, kv, workload
        self.live: dict[str, Request] = {}
        self.done: dict[str, Request] = {}
        self.refused: set[str] = set()
        self.result = SchedulerRun()
        # Seconds the scheduler has held its work in a row (merge windows), bounded by rule scheduler.progress.
        self._held_s = 0.0

    def run(self) -> SchedulerRun:
        pending = sorted(enumerate(self.workload.requests), key=lambda item: item[1].arrival_step)
        total_tokens = sum(len(r.prompt_token_ids) + r.max_tokens for r in self.workload.requests)
        # Generous: every token computed twice over (preemptions recompute), one per step, plus the arrival gap.
        max_steps = 4 * total_tokens + max(r.arrival_step for r in self.workload.requests) + 16
        step = 0
        while pending or self.live:
            while pending and pending[0][1].arrival_step <= step:
                index, spec = pending.pop(0)
                self._add(index, spec)
            self._abort_due(step)
            require(step < max_steps, "scheduler.progress",
                    f"{len(self.live)} request(s) still unfinished after {max_steps} steps")
            out = self._schedule(step)
            if out.hold_s > 0 and not out.scheduled and not out.preempted:
                self._held_s += out.hold_s
                require(self._held_s <= MAX_HOLD_S, "scheduler.progress",
                        f"step {step}: held waiting work for {self._held_s:.3f}s in a row (at most {MAX_HOLD_S}s)")
                time.sleep(out.hold_s)
                continue
            self._held_s = 0.0
            self._check(step, out)
            self._advance(out)
            step += 1
        self.result.num_steps = step
        return self.result

    def _add(self, index: int, spec: WorkloadRequest) -> None:
        req = Request(f"r{index}", list(spec.prompt_token_ids), SamplingParams(max_tokens=spec.max_tokens))
        try:
            self.scheduler.add_request(req)
        except AdmissionRefused as exc:
            require(str(exc) != "" and exc.retry_after_s > 0, "scheduler.admission",
                    f"{req.req_id} refused without a reason or a positive retry-after: {exc!r}")
            require(not self.kv.block_ids(req.req_id), "scheduler.admission",
                    f"{req.req_id} was refused but holds KV blocks")
            self.refused.add(req.req_id)
            self.result.num_refused += 1
            return
        self.live[req.req_id] = req

    def _abort_due(self, step: int) -> None:
        for req_id, spec in self._specs():
            req = self.live.get(req_id)
            if req is not None and spec.abort_step is not None and spec.abort_step <= step:
                req.status = RequestStatus.FINISHED_ABORTED
                self._finish(req)
                self.result.num_aborted += 1

    def _specs(self):
        return ((f"r{i}", spec) for i, spec in enumerate(self.workload.requests))

    def _schedule(self, step: int) -> SchedulerOutput:
        try:
            out = self.scheduler.schedule()
        except ContractViolation:
            raise
        except RtxError as exc:  # the KV-cache manager refusing a call: a misuse, reported as such
            raise ContractViolation("scheduler.kv_protocol", f"step {step}: {exc}") from exc
        require(isinstance(out, SchedulerOutput), "scheduler.api",
                f"step {step}: schedule() returned {type(out).__name__}, not a SchedulerOutput")
        for name in ("num_waiting", "num_running"):
            value = getattr(self.scheduler, name)
            require(isinstance(value, int) and not isinstance(value, bool), "scheduler.api",
                    f"step {step}: {name} is {value!r} ({type(value).__name__}), not an int")
        return out

    def _check(self, step: int, out: SchedulerOutput) -> None:
        config = self.workload.config
        total = sum(out.num_scheduled_tokens)
        require(total <= config.max_num_batched_tokens, "scheduler.token_budget",
                f"step {step} scheduled {total} tokens, budget is {config.max_num_batched_tokens}")
        require(len(out.scheduled) == len(out.num_scheduled_tokens), "scheduler.known_tokens",
                f"step {step}: {len(out.scheduled)} requests but {len(out.num_scheduled_tokens)} token counts")
        ids = [req.req_id for req in out.scheduled]
        require(len(set(ids)) == len(ids), "scheduler.no_duplicates", f"step {step} scheduled {ids}")
        require(self.scheduler.num_running <= config.max_num_seqs and len(ids) <= config.max_num_seqs,
                "scheduler.max_num_seqs", f"step {step}: {self.scheduler.num_running} running, "
                f"{len(ids)} scheduled, max_num_seqs is {config.max_num_seqs}")
        for req, n in zip(out.scheduled, out.num_scheduled_tokens):
            require(req.req_id not in self.refused, "scheduler.admission",
                    f"step {step} scheduled {req.req_id}, which add_request refused")
            require(req.req_id in self.live and self.live[req.req_id] is req, "scheduler.finished_stay_out",
                    f"step {step} scheduled {req.req_id}, which finished or was never added")
            left = req.num_tokens - req.num_computed_tokens
            require(1 <= n <= left, "scheduler.known_tokens",
                    f"step {step} scheduled {n} tokens of {req.req_id}, which has {left} to compute")
            held = len(self.kv.block_ids(req.req_id)) * self.kv.block_size
            require(held >= req.num_computed_tokens + n, "scheduler.kv_capacity",
                    f"step {step}: {req.req_id} holds KV for {held} tokens but will have "
                    f"{req.num_computed_tokens + n} computed")
        scheduled = set(ids)
        for req in out.preempted:
            require(req.req_id not in scheduled, "scheduler.preemption",
                    f"step {step} both preempted and scheduled {req.req_id}")
            require(not self.kv.block_ids(req.req_id) and req.num_computed_tokens == 0, "scheduler.preemption",
                    f"step {step}: preempted {req.req_id} still holds {len(self.kv.block_ids(req.req_id))} "
                    f"blocks / {req.num_computed_tokens} computed tokens")
        self.result.num_preemptions += len(out.preempted)
        self.result.max_step_tokens = max(self.result.max_step_tokens, total)
        accounted = self.scheduler.num_waiting + self.scheduler.num_running
        require(accounted == len(self.live), "scheduler.no_drop",
                f"step {step}: {len(self.live)} unfinished requests but the scheduler accounts for {accounted} "
                f"({self.scheduler.num_waiting} waiting, {self.scheduler.num_running} running)")
        require(bool(out.scheduled) or bool(out.preempted) or not self.live, "scheduler.progress",
                f"step {step} scheduled nothing while {len(self.live)} request(s) wait and each fits the cache")
        try:
            self.kv.check_invariants()
        except RtxError as exc:
            raise ContractViolation("scheduler.kv_protocol", f"after step {step}: {exc}") from exc

    def _advance(self, out: SchedulerOutput) -> None:
        for req, n in zip(out.scheduled, out.num_scheduled_tokens):
            req.num_computed_tokens += n
            if req.num_computed_tokens == req.num_tokens:
                # Any token will do; a varied one keeps block hashes distinct.
                req.all_token_ids.append(1000 + len(req.all_token_ids) % 7)
                if req.num_output_tokens >= req.params.max_tokens:
                    req.status = RequestStatus.FINISHED_LENGTH
                    self._finish(req)
                    self.result.num_finished += 1
                    self.result.finished_ids.append(req.req_id)

    def _finish(self, req: Request) -> None:
        del self.live[req.req_id]
        self.done[req.req_id] = req
        self.scheduler.finish_request(req)
        require(not self.kv.block_ids(req.req_id), "scheduler.finished_stay_out",
                f"{req.req_id} finished but still holds {len(self.kv.block_ids(req.req_id))} KV blocks")
