"""The rtx_spec_* families: after a speculative generation they equal the speculator's own counters, per proposer."""

from __future__ import annotations

import asyncio

import pytest

from rtxcore.engine.async_engine import AsyncEngine
from rtxcore.engine.speculation.config import SpeculativeConfig
from rtxcore.metrics import EngineMetrics
from rtxcore.sampling_params import SamplingParams
from tests.helpers.engines import make_engine
from tests.metrics.test_metrics import collect, parse, value, wait_idle

FAMILIES = {"rtx_spec_proposed_tokens": "num_proposed_tokens", "rtx_spec_accepted_tokens": "num_accepted_tokens",
            "rtx_spec_verifications": "num_verifications"}
# Prompts that repeat: prompt lookup finds continuations, some of which the model accepts.
PROMPTS = [[17, 42, 99, 256, 7] * 6, [9] * 20, list(range(100, 130)) * 2]
PARAMS = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)


def spec_engine(registry, method: str = "ngram"):
    return make_engine(registry=registry, speculative=SpeculativeConfig(method=method))


async def generate_all(engine: AsyncEngine) -> None:
    await asyncio.gather(*(collect(engine, p, PARAMS) for p in PROMPTS))
    await wait_idle(engine)


def assert_exported(metrics: EngineMetrics, stats, proposer: str) -> None:
    families = parse(metrics)
    for family, counter in FAMILIES.items():
        assert value(families, family, f"{family}_total", proposer=proposer) == getattr(stats, counter), family
    hist = "rtx_spec_accepted_length"
    assert value(families, hist, f"{hist}_count", proposer=proposer) == stats.num_verifications
    assert value(families, hist, f"{hist}_sum", proposer=proposer) == stats.num_accepted_tokens
    # Bucket le=n counts the verifications that accepted at most n tokens.
    for n in (0, 1, 4, 16):
        expected = sum(stats.accepted_runs[:n + 1])
        assert value(families, hist, f"{hist}_bucket", proposer=proposer, le=f"{float(n)}") == expected, n


def test_counters_follow_a_speculative_generate(registry):
    engine = spec_engine(registry)
    metrics = EngineMetrics("tiny")
    observer = metrics.observer()
    for prompt in PROMPTS:
        engine.add_request(prompt, PARAMS)
    while engine.has_unfinished_requests():
        observer.on_step(engine.core, engine.step(), 0.001)
    stats = engine.core.speculator.stats
    assert stats["ngram"].num_verifications > 0 and stats["ngram"].num_accepted_tokens > 0
    assert_exported(metrics, stats["ngram"], "ngram")
    # Every proposer the engine holds has its series from the start, at 0 when it did nothing.
    assert_exported(metrics, stats["assisted"], "assisted")
    assert stats["assisted"].num_verifications == 0
    # A reading without news adds nothing.
    before = parse(metrics)
    observer.on_idle(engine.core)
    assert parse(metrics) == before


def test_counters_from_a_served_engine_and_a_second_engine(registry):
    """Through AsyncEngine (each step and idle tick); an engine built later starts its counters at 0 again, and the
    exported totals go on from where they were."""
    metrics = EngineMetrics("tiny")
    totals = {}
    for _ in range(2):
        engine = AsyncEngine(spec_engine(registry).core, observers=[metrics.observer()])
        engine.start()
        try:
            asyncio.run(generate_all(engine))
        finally:
            engine.stop()
        for name, stats in engine.core.speculator.stats.items():
            for counter in FAMILIES.values():
                totals[name, counter] = totals.get((name, counter), 0) + getattr(stats, counter)
    families = parse(metrics)
    for family, counter in FAMILIES.items():
        assert value(families, family, f"{family}_total", proposer="ngram") == totals["ngram", counter] > 0


@pytest.mark.parametrize("method", ["layer-skip"])
def test_other_proposers_are_labelled_by_name(registry, method):
    engine = spec_engine(registry, method)
    metrics = EngineMetrics("tiny")
    observer = metrics.observer()
    engine.add_request(PROMPTS[0], PARAMS)
    while engine.has_unfinished_requests():
        observer.on_step(engine.core, engine.step(), 0.001)
    assert_exported(metrics, engine.core.speculator.stats[method], method)
    assert engine.core.speculator.stats[method].num_verifications > 0
