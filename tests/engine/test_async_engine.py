"""The asyncio driver: concurrent streams, validation errors, aborts freeing blocks, embeddings between steps."""

from __future__ import annotations

import asyncio
import time

import pytest

from rtxcore.capacity.step_time import StepTimeModel
from rtxcore.engine.async_engine import AsyncEngine, StepObserver
from rtxcore.errors import EngineFailed, InvalidRequestError
from rtxcore.sampling_params import SamplingParams
from tests.helpers.engines import make_engine

GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)


@pytest.fixture
def async_engine(registry):
    engine = AsyncEngine(make_engine(registry=registry).core)
    engine.start()
    yield engine
    engine.stop()


async def collect(async_engine, prompt, params=GREEDY):
    tokens = []
    async for out in async_engine.generate(prompt, params):
        tokens.extend(out.new_token_ids)
    return tokens


def test_concurrent_streams_match_offline(async_engine):
    prompts = [[10 + i, 20 + i, 30 + i, 40 + i] * (i + 1) for i in range(8)]
    offline = [r.token_ids for r in make_engine(registry=async_engine.core.registry).generate(prompts, GREEDY)]

    async def main():
        return await asyncio.gather(*(collect(async_engine, p) for p in prompts))

    assert asyncio.run(main()) == offline


def test_validation_error_raises_before_streaming(async_engine):
    async def main():
        with pytest.raises(InvalidRequestError, match="empty"):
            await collect(async_engine, [])
        return await collect(async_engine, [5, 6, 7])

    assert len(asyncio.run(main())) == GREEDY.max_tokens


def test_leaving_a_stream_aborts_and_frees_blocks(async_engine):
    kv = async_engine.core.kv_cache
    idle = kv.num_free_blocks

    async def main():
        stream = async_engine.generate(list(range(10, 90)), SamplingParams(max_tokens=500, ignore_eos=True))
        async for _ in stream:
            break
        await stream.aclose()
        for _ in range(100):
            if not async_engine.core.has_unfinished_requests():
                break
            await asyncio.sleep(0.01)

    asyncio.run(main())
    assert not async_engine.core.has_unfinished_requests()
    assert kv.num_free_blocks == idle


def test_embeddings_are_normalized_and_deterministic(async_engine):
    async def main():
        return await async_engine.embed([[5, 6, 7], [5, 6, 7], [9, 9, 9, 9, 9]])

    a, b, c = asyncio.run(main())
    assert a == b and a != c
    assert abs(sum(x * x for x in a) - 1.0) < 1e-5


def test_long_embeddings_and_prompt_scoring_take_turns_with_steps(registry):
    # Twelve inputs of a whole step's budget each: one pass between two steps while a stream runs, not twelve in a
    # row; and a caller that stops waiting leaves the passes not yet run undone.
    core = make_engine(registry=registry, max_num_batched_tokens=64).core
    engine = AsyncEngine(core)
    calls: list[tuple[str, int]] = []
    real_embed, real_score = core.embed, core.prompt_logprobs
    core.embed = lambda lists: calls.append(("embed", engine.num_steps)) or real_embed(lists)
    core.prompt_logprobs = lambda lists, top: calls.append(("score", engine.num_steps)) or real_score(lists, top)
    engine.start()
    inputs = [[5 + i] * 64 for i in range(12)]
    stream = SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True)

    async def main():
        generation = asyncio.ensure_future(collect(engine, [1, 2, 3], stream))
        while engine.num_steps < 2:
            await asyncio.sleep(0.001)
        vectors = await engine.embed(inputs)
        scored = await engine.prompt_logprobs([[7] * 600, [8] * 600, [9] * 600], 1)
        cancelled = asyncio.ensure_future(engine.embed(inputs))
        while len(calls) < 16:
            await asyncio.sleep(0.001)
        cancelled.cancel()
        await asyncio.sleep(0.2)
        return vectors, scored, await generation
    try:
        vectors, scored, tokens = asyncio.run(main())
    finally:
        engine.stop()
    assert len(vectors) == 12 and vectors == [v for v in core.embed(inputs)]
    assert [len(s) for s in scored] == [600] * 3 and len(tokens) == 60
    steps = [n for kind, n in calls[:15]]
    assert [kind for kind, _ in calls[:15]] == ["embed"] * 12 + ["score"] * 3  # one call per group
    assert all(b > a for a, b in zip(steps, steps[1:])), steps  # a step between every two passes
    assert len(calls) < 15 + 12  # the cancelled call's remaining passes never ran


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")  # the engine thread's end
def test_work_queued_when_the_engine_fails_or_stops_ends_with_an_error(registry):
    core = make_engine(registry=registry).core

    def broken_step():
        raise RuntimeError("step broke")
    core.step = broken_step
    engine = AsyncEngine(core)
    engine.start()

    async def main():
        work = [asyncio.ensure_future(collect(engine, [1, 2, 3]))]
        work += [asyncio.ensure_future(engine.embed([[4, 5, 6]] * 2)) for _ in range(3)]
        ended = await asyncio.wait_for(asyncio.gather(*work, return_exceptions=True), 30)
        with pytest.raises(EngineFailed, match="step broke"):  # queued after the end: not left waiting
            await asyncio.wait_for(engine.embed([[4, 5, 6]]), 30)
        return ended
    ended = asyncio.run(main())
    assert isinstance(ended[0], EngineFailed) and "step broke" in str(ended[0])
    assert any(isinstance(e, EngineFailed) for e in ended[1:])  # passes queued behind the failed step
    assert all(isinstance(e, (EngineFailed, list)) for e in ended[1:])

    stopped = AsyncEngine(make_engine(registry=registry).core)
    stopped.start()
    stopped.stop()

    async def after_stop():
        with pytest.raises(EngineFailed, match="stopped"):
            await asyncio.wait_for(stopped.embed([[4, 5, 6]]), 30)
        with pytest.raises(EngineFailed, match="stopped"):
            await asyncio.wait_for(collect(stopped, [1, 2, 3]), 30)
    asyncio.run(after_stop())


def test_cancelled_waits_leave_the_engine_running(async_engine):
    """A job or submission whose caller stopped waiting (a client deadline, a disconnect) while the engine thread
    was busy: the engine once called set_result on the cancelled future and died, failing every stream."""
    started = asyncio.Event()

    async def main():
        loop = asyncio.get_running_loop()
        busy = asyncio.ensure_future(async_engine.run_on_engine(
            lambda engine: (loop.call_soon_threadsafe(started.set), time.sleep(0.3))))
        await started.wait()  # the engine thread is inside the first job: what follows waits in its inbox
        job = asyncio.ensure_future(async_engine.embed([[5, 6, 7]]))
        stream = async_engine.generate([5, 6, 7], GREEDY)
        first = asyncio.ensure_future(stream.__anext__())
        await asyncio.sleep(0.05)
        job.cancel()
        first.cancel()
        await busy
        return await collect(async_engine, [8, 9, 10])

    assert len(asyncio.run(asyncio.wait_for(main(), 30))) == GREEDY.max_tokens
    assert async_engine.is_running
    assert not async_engine.core.has_unfinished_requests() and async_engine.num_active == 0


def test_a_late_abort_does_not_stop_a_request_that_reused_the_id(async_engine):
    async def main():
        first = async_engine.generate([5, 6, 7], SamplingParams(max_tokens=3, ignore_eos=True), req_id="x")
        await first.__anext__()
        for _ in range(200):  # the engine finishes "x"; its last outputs stay unread
            if "x" not in async_engine.core.requests:
                break
            await asyncio.sleep(0.01)
        tokens = []
        second = async_engine.generate([1, 2, 3], SamplingParams(max_tokens=50, ignore_eos=True), req_id="x")
        tokens.extend((await second.__anext__()).new_token_ids)
        await first.aclose()  # the first client leaves: its abort must not reach the second request
        async for out in second:
            tokens.extend(out.new_token_ids)
        return tokens

    assert len(asyncio.run(asyncio.wait_for(main(), 30))) == 50


def test_a_stream_whose_event_loop_closed_is_aborted(registry):
    aborted = []
    async_engine = AsyncEngine(make_engine(registry=registry).core, observers=[
        StepObserver(on_step=lambda *_: None, on_abort=lambda engine, out: aborted.append(out.req_id))])
    async_engine.start()
    try:
        loop = asyncio.new_event_loop()
        stream = async_engine.generate([5, 6, 7], SamplingParams(max_tokens=1500, ignore_eos=True), req_id="r")
        loop.run_until_complete(stream.__anext__())
        loop.close()  # gone without closing its stream: the next output cannot be delivered
        for _ in range(500):
            if not async_engine.core.has_unfinished_requests():
                break
            time.sleep(0.01)
        # aborted, not run on to max_tokens with nobody reading
        assert aborted == ["r"] and async_engine.num_active == 0
    finally:
        async_engine.stop()


def test_the_step_time_profile_does_not_count_an_idle_wait_in_the_last_step_before_it(async_engine):
    """The engine's step-time recorder takes the gap between two schedules as the first one's step; after the last
    request ends the loop waits for work, and that wait is not a step's time."""
    learnt: list[float] = []

    class KeptModel(StepTimeModel):
        """The recorder's model, keeping each step time it learns."""

        def observe(self, num_tokens: int, seconds: float) -> None:
            learnt.append(seconds)
            super().observe(num_tokens, seconds)

    recorder = async_engine.core.step_times
    recorder.model = KeptModel(recorder.model.forget, recorder.model.min_samples)
    idle_s = 0.8

    async def main():
        await collect(async_engine, [5, 6, 7], SamplingParams(max_tokens=3, ignore_eos=True))
        await asyncio.sleep(idle_s)  # the engine idles
        await collect(async_engine, [8, 9, 10], SamplingParams(max_tokens=3, ignore_eos=True))

    asyncio.run(main())
    # Both requests' steps were timed (three each: a prefill and two decodes; the first request's last one too).
    assert len(learnt) >= 5
    assert max(learnt) < idle_s / 2, learnt
