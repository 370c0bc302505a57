"""Offline throughput of the engine on a list of requests (continuous or static batching)."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from rtxcore.bench.engine import Engine, drain, generate
from rtxcore.bench.workloads import BenchRequest
from rtxcore.capacity.step_time import nearest_rank
from rtxcore.engine.outputs import RequestOutput
from rtxcore.sampling_params import SamplingParams

# progress(done, total), as rtxcore.cli.progress.Progress takes it.
Progress = Callable[[int, int], None]


@dataclass(slots=True)
class ThroughputResult:
    label: str
    num_requests: int
    output_tokens: int
    prompt_tokens: int
    elapsed_s: float
    # Seconds from the start of the run to each request's first token (with static batching, a later batch's
    # requests are submitted only when the batch before it has finished: their wait counts).
    ttft_s: list[float] = field(default_factory=list)

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.elapsed_s

    def ttft_percentile(self, q: float) -> float:
        return nearest_rank(self.ttft_s, q)

    @property
    def ms_per_token_per_request(self) -> float:
        """Mean time per output token of one stream (W3's figure when there is one request)."""
        return 1000 * self.elapsed_s * self.num_requests / self.output_tokens


def _params(r: BenchRequest) -> SamplingParams:
    return SamplingParams(max_tokens=r.output_len, temperature=0.0, ignore_eos=True)


def run_engine(engine: Engine, requests: list[BenchRequest], label: str = "rtx engine",
               static_batching: bool = False, progress: Progress | None = None) -> ThroughputResult:
    """:param static_batching: admit the next batch only when the whole previous one finished (the classic
    baseline), with batches as large as the engine's max_num_seqs.
    :param progress: called as ``progress(num_finished, num_requests)``: with 0 at the start, then after each step
        that finished a request.
    """
    if progress is not None:
        progress(0, len(requests))
    first_token_times: list[float] = []
    on_step = _watch_finished(first_token_times, progress, len(requests))
    # Request timings are on the monotonic clock.
    start, start_monotonic = time.perf_counter(), time.monotonic()
    produced = 0
    if static_batching:
        size = engine.core.config.scheduling.max_num_seqs
        for i in range(0, len(requests), size):
            produced += _drain(engine, requests[i:i + size], on_step)
    else:
        produced = _drain(engine, requests, on_step)
    elapsed = time.perf_counter() - start
    return ThroughputResult(label, len(requests), produced, sum(len(r.prompt_token_ids) for r in requests), elapsed,
                            [t - start_monotonic for t in first_token_times])


def _drain(engine: Engine, requests: list[BenchRequest], on_step: Callable | None = None) -> int:
    return drain(engine, ((r.prompt_token_ids, _params(r)) for r in requests), on_step)


def _watch_finished(first_token_times: list[float], progress: Progress | None, total: int) -> Callable:
    """A ``drain`` step hook that keeps each finished request's first-token time and reports the requests finished
    so far, only after a step that finished one (most finish none: the timed loop pays for a look at each step's
    outputs and little more)."""
    num_finished = 0

    def on_step(step: Callable[[], list[RequestOutput]]) -> list[RequestOutput]:
        nonlocal num_finished
        outputs = step()
        finished = [o for o in outputs if o.finished]
        if finished:
            first_token_times.extend(o.timings.first_token_time for o in finished
                                     if o.timings is not None and o.timings.first_token_time is not None)
            num_finished += len(finished)
            if progress is not None:
                progress(num_finished, total)
        return outputs
    return on_step


def warm_up(engine: Engine, requests: list[BenchRequest] | None = None, progress: Progress | None = None,
            static_batching: bool = False) -> None:
    """Run work that is not timed, so one-time costs stay out of the figures.

    On an accelerator, kernels are compiled and autotuned per shape the first time each runs, and one short request
    reaches only a few of the shapes a workload needs: there the workload itself runs once, batched as the timed run
    will be (static batching makes steps of other shapes: on an H100 its first W2 run at 64 running spent 0.54 s of
    8.4 s compiling them, which had flattered continuous batching's ratio). On the CPU nothing is compiled per shape
    and one short request will do.

    :param progress: as for :func:`run_engine`, when the workload runs.
    """
    if requests and engine.core.backend.device.type != "cpu":
        run_engine(engine, requests, progress=progress, static_batching=static_batching)
    else:
        generate(engine, [[100 + i for i in range(16)]], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    engine.core.kv_cache.reset_prefix_cache()
