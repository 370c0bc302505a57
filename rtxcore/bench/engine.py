"""The benchmarks' one door into the engine.

Everything under ``rtxcore/bench`` and ``benchmarks/`` builds engines and moves requests through them with these
functions and nothing else, so that when the engine's classes change only this file has to follow. Benchmarks read
what they report from the engine core (``engine.core.backend``, ``engine.core.kv_cache``, ...).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from rtxcore.engine.async_engine import AsyncEngine
from rtxcore.engine.config import EngineConfig
from rtxcore.engine.llm import LLM
from rtxcore.sampling_params import SamplingParams

Engine = LLM
"""The type the benchmarks hold: an offline engine with ``generate`` and a step loop."""


def build_engine(config: EngineConfig | None = None, *, source: Any = None, **options: Any) -> Engine:
    """An engine for ``config``, or for ``EngineConfig(**options)``; ``source`` replaces the model's weights source
    (e.g. weights drawn once and shared by several engines)."""
    if config is None:
        config = EngineConfig(**options)
    elif options:
        raise TypeError("give either an EngineConfig or its options, not both")
    return LLM(config, source=source) if source is not None else LLM(config)


def serving_engine(engine: Engine) -> AsyncEngine:
    """The asyncio front of ``engine``, as ``rtx serve`` drives it (streams, arrivals while steps run)."""
    return AsyncEngine(engine.core)


def generate(engine: Engine, prompts: list[list[int]], params: SamplingParams) -> list:
    """Run ``prompts`` to completion together; one result per prompt (``token_ids``, ``num_cached_tokens``)."""
    return engine.generate(prompts, params)


def drain(engine: Engine, requests: Iterable[tuple[list[int], SamplingParams]], on_step=None) -> int:
    """Add every request, then step until none is left; returns the output tokens produced.

    :param on_step: called around each step as ``on_step(step)`` where ``step()`` runs the step and returns its
        outputs, for benchmarks that time or inspect steps one by one.
    """
    for prompt, params in requests:
        engine.add_request(prompt, params)
    produced = 0
    while engine.has_unfinished_requests():
        outputs = on_step(engine.step) if on_step else engine.step()
        produced += sum(len(o.new_token_ids) for o in outputs)
    return produced
