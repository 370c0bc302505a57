"""A scheduler plugin that fails stops the engine (it holds every request's place), with an error naming it and
leaving the prompt out; unlike the faults of tests/engine/test_faults.py, which end one request."""

from __future__ import annotations

import asyncio

import pytest

from rtx_plugins.schedulers.fcfs import FCFSScheduler
from rtxcore.engine.async_engine import AsyncEngine
from rtxcore.errors import EngineFailed
from rtxcore.hookspecs import hookimpl
from rtxcore.registry import load_plugins
from rtxcore.sampling_params import SamplingParams
from tests.helpers.engines import make_engine

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


class RaisingScheduler(FCFSScheduler):
    """Raises on a request once it runs, with the request in the exception (as a dict lookup does)."""

    def schedule(self):
        out = super().schedule()
        if self.running:
            raise KeyError(self.running[0])
        return out


class OverBudgetScheduler(FCFSScheduler):
    def schedule(self):
        out = super().schedule()
        out.num_scheduled_tokens = [n + self.config.max_num_batched_tokens for n in out.num_scheduled_tokens]
        return out


class NoneScheduler(FCFSScheduler):
    def schedule(self):
        return None


class FaultySchedulers:
    @hookimpl
    def register_schedulers(self, register):
        register("raising", RaisingScheduler)
        register("over-budget", OverBudgetScheduler)
        register("none", NoneScheduler)


@pytest.fixture(scope="module")
def faulty_registry():
    return load_plugins(extra=[("faulty-schedulers", FaultySchedulers())])


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")  # the engine thread's end
@pytest.mark.parametrize(("scheduler", "message"), [
    ("raising", "scheduler plugin 'raising' failed: KeyError: Request(req_id="),
    ("over-budget", "scheduler plugin 'over-budget' scheduled 2051 tokens, past the step's budget of 2048"),
    ("none", "scheduler plugin 'none' returned NoneType, not a SchedulerOutput"),
])
def test_a_scheduler_failing_stops_the_engine_naming_it_without_the_prompt(faulty_registry, scheduler, message):
    # The scheduler holds every request's place: the engine cannot go on without it. The error names the plugin and
    # leaves the prompt's tokens out (a request's repr does), since it reaches HTTP answers and /health.
    prompt = [401, 402, 403]
    engine = make_engine(registry=faulty_registry, scheduler=scheduler)
    with pytest.raises(EngineFailed) as info:
        engine.generate([prompt], GREEDY)
    assert message in str(info.value) and "401, 402" not in str(info.value)

    served = AsyncEngine(make_engine(registry=faulty_registry, scheduler=scheduler).core)
    served.start()

    async def run():
        return [out async for out in served.generate(prompt, GREEDY)]
    try:
        with pytest.raises(EngineFailed) as info:
            asyncio.run(run())
    finally:
        served.stop()
    assert str(info.value).startswith(f"engine failed: {message}") and "401, 402" not in str(info.value)
