"""Engines for tests: a tiny random-weight model by default, any model or setting by keyword."""

from __future__ import annotations

from rtxcore.contracts.scheduler import SchedulerConfig
from rtxcore.engine.config import EngineConfig
from rtxcore.engine.llm import LLM


def make_engine(model: str = "dummy:tiny", *, registry=None, source=None, **kwargs) -> LLM:
    scheduling = SchedulerConfig(**{k: kwargs.pop(k) for k in ("max_num_batched_tokens", "max_num_seqs")
                                    if k in kwargs})
    config = EngineConfig(model=model, scheduling=scheduling, **kwargs)
    return LLM(config, registry=registry, source=source)
