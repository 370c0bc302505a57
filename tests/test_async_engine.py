"""The asyncio driver: concurrent streams, validation errors, aborts freeing blocks, embeddings between steps."""

from __future__ import annotations

import asyncio

import pytest

from conftest import make_engine
from rtxcore.engine.async_engine import AsyncEngine
from rtxcore.errors import InvalidRequestError
from rtxcore.sampling_params import SamplingParams

GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)


@pytest.fixture
def async_engine(registry):
    engine = AsyncEngine(make_engine(registry=registry))
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
    offline = [r.token_ids for r in make_engine(registry=async_engine.engine.registry).generate(prompts, GREEDY)]

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
    kv = async_engine.engine.kv_cache
    idle = kv.num_free_blocks

    async def main():
        stream = async_engine.generate(list(range(10, 90)), SamplingParams(max_tokens=500, ignore_eos=True))
        async for _ in stream:
            break
        await stream.aclose()
        for _ in range(100):
            if not async_engine.engine.has_unfinished_requests():
                break
            await asyncio.sleep(0.01)

    asyncio.run(main())
    assert not async_engine.engine.has_unfinished_requests()
    assert kv.num_free_blocks == idle


def test_embeddings_are_normalized_and_deterministic(async_engine):
    async def main():
        return await async_engine.embed([[5, 6, 7], [5, 6, 7], [9, 9, 9, 9, 9]])

    a, b, c = asyncio.run(main())
    assert a == b and a != c
    assert abs(sum(x * x for x in a) - 1.0) < 1e-5
