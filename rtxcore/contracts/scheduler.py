"""Scheduler contract: decide which requests run this step and how many of their tokens to compute.

A scheduler never touches KV blocks. It asks a :class:`KVCacheAllocator` for room and gets ``True`` or ``False``
back ("does not fit: preempt someone or wait"); block ids stay inside the cache manager.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from rtxcore.errors import ConfigError
from rtxcore.lanes import DEFAULT_LANES, LaneSpec
from rtxcore.request import Request


@dataclass(slots=True)
class SchedulerConfig:
    # Most tokens (prefill chunks plus decodes) computed in one step.
    max_num_batched_tokens: int = 2048
    # Most requests running at once.
    max_num_seqs: int = 256
    # A prompt longer than what is left of the budget is prefilled in chunks instead of stalling decodes.
    enable_chunked_prefill: bool = True
    # SLA lanes by name; lane-aware schedulers act on their targets, others may ignore them.
    lanes: dict[str, LaneSpec] = field(default_factory=lambda: dict(DEFAULT_LANES))
    # Whether the engine speculates with a proposer (a scheduler with brownout may then pause speculation).
    speculative: bool = False
    # Settings only one scheduler plugin understands (e.g. sla-lanes' ``brownout`` table), by plugin convention.
    options: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.max_num_batched_tokens < 1:
            raise ConfigError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        if self.max_num_seqs < 1:
            raise ConfigError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")


class KVCacheAllocator(Protocol):
    """What a scheduler may ask of the KV-cache manager."""

    def lookup_prefix(self, req: Request) -> int:
        """Find cached blocks for the request's prefix and hold them; returns the number of tokens they cover.

        Called once, before the request's first allocation; a later :meth:`free` releases the hold.
        """

    def allocate(self, req: Request, num_new_tokens: int) -> bool:
        """Make room for ``num_new_tokens`` more tokens of ``req``; ``False`` (and nothing changed) if it does not
        fit."""

    def free(self, req: Request) -> None:
        """Release every block the request holds; full blocks stay in the prefix cache as evictable."""

    def ready(self, req: Request) -> bool:
        """Whether the blocks :meth:`lookup_prefix` found are all on the device. ``False`` while some are still being
        copied back from a lower tier (host memory), or read from disk: a scheduler should leave the request waiting,
        with its hold, and let requests behind it go first. Scheduling it anyway is correct but makes the step wait
        for the copy, or computes what the disk reads would have brought. When it answers ``True`` after disk reads,
        the hit may have grown: ``req.num_computed_tokens`` is then raised to it."""

    @property
    def num_free_blocks(self) -> int:
        """Blocks that can be handed out now, evictable cached blocks included."""


@dataclass(slots=True)
class SchedulerOutput:
    # Requests that run this step, in batch order.
    scheduled: list[Request] = field(default_factory=list)
    # Tokens to compute per scheduled request (a prefill chunk, or 1 for a decode), same order as ``scheduled``.
    num_scheduled_tokens: list[int] = field(default_factory=list)
    # Requests preempted this step (their KV freed; they will recompute from the start).
    preempted: list[Request] = field(default_factory=list)
    # Nothing scheduled on purpose: the scheduler holds waiting work for up to this many seconds to merge it with
    # arrivals about to come (a batch merge window). The engine steps again when it passes or a request arrives.
    hold_s: float = 0.0

    @property
    def total_num_scheduled_tokens(self) -> int:
        """Tokens computed this step, over every scheduled request."""
        return sum(self.num_scheduled_tokens)

    @property
    def is_empty(self) -> bool:
        """Whether nothing is scheduled this step."""
        return not self.scheduled


class Scheduler(ABC):
    """Continuous-batching policy. The engine calls :meth:`schedule` once per step."""

    def __init__(self, config: SchedulerConfig, kv_cache: KVCacheAllocator):
        self.config = config
        self.kv_cache = kv_cache

    @classmethod
    def check_options(cls, options: Mapping[str, Any]) -> None:
        """Refuse options this scheduler cannot take (``SchedulerConfig.options``: the config file's
        ``[scheduler]`` table, ``[brownout]`` under the key ``"brownout"``) by raising
        :class:`rtxcore.errors.ConfigError` naming the setting. ``rtx serve`` calls it before the model loads, so a
        typo fails in a second rather than after the weights are read. Optional: by default nothing is checked here
        (the constructor still may refuse).
        """

    @abstractmethod
    def add_request(self, req: Request) -> None:
        """Queue a new request (status WAITING).

        :raises rtxcore.errors.AdmissionRefused: the scheduler will not take it now (queue full, predicted to miss
            its lane's target, shed by brownout); nothing is changed and the server answers 429 with Retry-After.
        """

    @abstractmethod
    def schedule(self) -> SchedulerOutput:
        """Pick this step's work within ``config``'s budget, allocating KV space through ``kv_cache``.

        Every scheduled request must have room for its scheduled tokens when this returns.
        """

    @abstractmethod
    def finish_request(self, req: Request) -> None:
        """Forget a request that finished or was aborted (the engine has set its final status).

        Must free its KV space through ``kv_cache.free``. Called exactly once per request. With asynchronous
        scheduling the engine calls it as soon as the request's last token has been launched, before that token's
        value is known: its status may then still be RUNNING.
        """

    @property
    @abstractmethod
    def num_waiting(self) -> int:
        """Requests queued and not running (preempted ones included)."""

    @property
    @abstractmethod
    def num_running(self) -> int:
        """Requests holding KV space."""

    def has_unfinished_requests(self) -> bool:
        """Whether any request is waiting or running (the engine steps while one is)."""
        return self.num_waiting + self.num_running > 0

    def allows_speculation(self) -> bool:
        """False while speculative decoding should pause for everyone (overload: brownout). Called once per step."""
        return True

    def status(self) -> SchedulerStatus | None:
        """Lane queues and brownout state for metrics and ``GET /v1/lanes``; None for a scheduler without lanes.

        Called from the engine thread between steps.
        """
        return None


@dataclass(slots=True)
class SchedulerStatus:
    # Requests queued per lane (preempted ones included).
    queued: dict[str, int]
    running: dict[str, int]
    # 0 when serving normally; each level adds one degradation step.
    brownout_level: int = 0
    # Names of the degradation steps in force, in order.
    brownout_steps: tuple[str, ...] = ()
    # The overload signal brownout acts on (1.0: a protected lane is predicted to just meet its target).
    pressure: float = 0.0
    # The scheduler's step-time model, (base seconds, seconds per token), once it has seen enough steps to trust
    # it; None otherwise. Exported so that capacity planning can use what the server learnt under real load.
    step_time: tuple[float, float] | None = None
    # Per lane, the time to first token the scheduler predicts for a request of the lane's recent mean prompt length
    # arriving now (what admission would compare with the target); None until its predictions are trusted.
    # Exported so that dashboards can set it beside the measured figure.
    predicted_ttft_s: dict[str, float] | None = None
