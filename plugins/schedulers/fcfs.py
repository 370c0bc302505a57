"""First-come, first-served continuous batching with chunked prefill and recompute preemption."""

from __future__ import annotations

import logging
from collections import deque

from rtxcore.contracts import Scheduler, SchedulerConfig, SchedulerOutput
from rtxcore.contracts.scheduler import KVCacheAllocator
from rtxcore.hookspecs import hookimpl
from rtxcore.kv.waiting_holds import WaitingHolds
from rtxcore.request import Request, RequestStatus

log = logging.getLogger(__name__)


class FCFSScheduler(Scheduler):
    """Running requests first (oldest first), then waiting ones in arrival order.

    When KV space runs out, the most recently admitted running request is preempted: its blocks are freed and it
    goes back to the front of the queue to be recomputed (its prefix is usually still in the prefix cache).
    """

    def __init__(self, config: SchedulerConfig, kv_cache: KVCacheAllocator):
        super().__init__(config, kv_cache)
        if config.options:
            # Warned, not refused: the Helm chart's config carries [brownout] for sla-lanes, and a deployment
            # switched to fcfs must still start. Silence would make a brownout that never triggers look configured.
            log.warning("the fcfs scheduler ignores the options %s (the config file's [scheduler] and [brownout] "
                        "tables are read by --scheduler sla-lanes)", ", ".join(sorted(config.options)))
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        # Waiting requests whose prefix is still coming back from a lower tier, stepped aside in this schedule.
        self._copying: list[Request] = []
        # Waiting requests holding a prefix lookup's blocks (they stepped aside while it came back).
        self._holding = WaitingHolds(kv_cache)

    @classmethod
    def describe(cls) -> dict[str, object]:
        return {"policy": "first-come first-served", "chunked_prefill": True, "preemption": "recompute"}

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def add_request(self, req: Request) -> None:
        req.status = RequestStatus.WAITING
        self.waiting.append(req)

    def finish_request(self, req: Request) -> None:
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self._holding.forget(req)
        self.kv_cache.free(req)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens

        # Every running request passes here every step: locals, no min() call and num_tokens written out (each
        # costs as much as the arithmetic around it), and a single allocate() call in the common case.
        running, allocate = self.running, self.kv_cache.allocate
        scheduled, num_scheduled_tokens = out.scheduled, out.num_scheduled_tokens
        index = 0
        while index < len(running) and budget > 0:
            req = running[index]
            # num_tokens_with_spec written out.
            num_new = (len(req.all_token_ids) + req.num_pending_tokens + len(req.spec_token_ids)
                       - req.num_computed_tokens)
            if num_new > budget:
                num_new = budget
            if (not allocate(req, num_new) and not self._allocate_without_holds(req, num_new)
                    and not self._preempt_until_fits(req, num_new, out)):
                break  # req itself was preempted: everything after it already was too
            scheduled.append(req)
            num_scheduled_tokens.append(num_new)
            budget -= num_new
            index += 1

        # Admitting new work right after a preemption would only preempt again.
        copying = self._copying
        # Requests whose prefix is on the way take a place too: each holds device blocks for its copy, and starting
        # copies for more requests than can run next would fill the pool with blocks nobody can run on yet.
        while (not out.preempted and self.waiting and budget > 0
               and len(self.running) + len(copying) < self.config.max_num_seqs):
            req = self.waiting[0]
            if req.num_computed_tokens == 0:
                req.num_computed_tokens = self.kv_cache.lookup_prefix(req)
            if not self.kv_cache.ready(req):
                # Its prefix is still coming back from a lower tier: those behind it go first meanwhile, and it
                # keeps its place (and its hold) at the head of the queue.
                copying.append(self.waiting.popleft())
                self._holding.add(req)
                continue
            num_new = req.num_tokens_with_spec - req.num_computed_tokens
            if num_new > budget and not self.config.enable_chunked_prefill:
                self._release(req)
                break
            num_new = min(num_new, budget)
            if not self.kv_cache.allocate(req, num_new) and not self._allocate_without_holds(req, num_new):
                self._release(req)
                break
            self.waiting.popleft()
            self._holding.forget(req)
            if req.status is RequestStatus.WAITING:
                req.num_cached_tokens = req.num_computed_tokens
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            out.scheduled.append(req)
            out.num_scheduled_tokens.append(num_new)
            budget -= num_new
        self.waiting.extendleft(reversed(copying))
        copying.clear()
        return out

    def _allocate_without_holds(self, req: Request, num_new: int) -> bool:
        """Allocate for ``req`` after dropping the prefix holds of waiting requests (those whose prefix is coming back
        from a lower tier, or was when they last stepped aside); False when nothing was held or it still does not
        fit. A hold is cheaper to give up than a running request: nothing has been computed on it, its blocks stay
        in the prefix cache, and the lookup is redone. Without this, requests holding copies behind a queue head that
        cannot fit would never be reached, and the pool never freed."""
        return self._holding.release_all_but(req) and self.kv_cache.allocate(req, num_new)

    def _preempt_until_fits(self, req: Request, num_new: int, out: SchedulerOutput) -> bool:
        """Preempt from the back of the running list until ``req`` fits; False if ``req`` itself had to go."""
        while True:
            victim = self.running.pop()
            self._preempt(victim, out)
            if victim is req:
                return False
            if self.kv_cache.allocate(req, num_new):
                return True

    def _preempt(self, req: Request, out: SchedulerOutput) -> None:
        self.kv_cache.free(req)
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        req.status = RequestStatus.PREEMPTED
        self.waiting.appendleft(req)
        out.preempted.append(req)

    def _release(self, req: Request) -> None:
        # Drop the prefix-cache hold taken by lookup_prefix; the lookup is redone when the request is retried.
        self._holding.release(req)


@hookimpl
def register_schedulers(register) -> None:
    register("fcfs", FCFSScheduler)
