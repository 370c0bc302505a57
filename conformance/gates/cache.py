"""The cache gate: prefix-cache hit rate on a steady multi-turn workload (W4 of WORKLOADS.md, scaled down).

Conversations run side by side; each turn's prompt is the conversation so far (earlier prompts and the model's
replies) plus new tokens, so everything but the new tokens and the last partial block could come from the cache.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from rtx_conformance.gates.config import CacheGate
from rtx_conformance.gates.latency import engine_for
from rtxcore.contracts.scheduler import SchedulerConfig
from rtxcore.registry import ComponentRecord, PluginRegistry
from rtxcore.sampling_params import SamplingParams


@dataclass(frozen=True, slots=True)
class CacheResult:
    hit_rate: float
    min_hit_rate: float
    num_prompt_tokens: int
    num_cached_tokens: int
    num_kv_blocks: int

    @property
    def passed(self) -> bool:
        return self.hit_rate >= self.min_hit_rate


def run_cache(gate: CacheGate, record: ComponentRecord, registry: PluginRegistry) -> CacheResult:
    rng = random.Random(gate.seed)
    longest = gate.num_turns * (gate.max_new_tokens + gate.output_len)
    num_blocks = int(gate.kv_blocks_factor * gate.num_conversations * -(-longest // gate.block_size)) + 1
    engine = engine_for(record, registry, gate.model, block_size=gate.block_size, num_kv_blocks=num_blocks,
                        max_model_len=longest + gate.block_size,
                        scheduling=SchedulerConfig(max_num_seqs=gate.num_conversations))
    vocab = engine.model_config.vocab_size
    params = SamplingParams(max_tokens=gate.output_len, temperature=0.0, ignore_eos=True)
    history: list[list[int]] = [[] for _ in range(gate.num_conversations)]
    prompt_tokens = cached_tokens = 0
    for turn in range(gate.num_turns):
        prompts = [h + [rng.randrange(3, vocab) for _ in range(rng.randint(gate.min_new_tokens, gate.max_new_tokens))]
                   for h in history]
        ids = {engine.add_request(p, params): i for i, p in enumerate(prompts)}
        replies: dict[int, list[int]] = {i: [] for i in ids.values()}
        while engine.has_unfinished_requests():
            for out in engine.step():
                replies[ids[out.req_id]] += out.new_token_ids
                if out.finished and turn > 0:
                    prompt_tokens += out.num_prompt_tokens
                    cached_tokens += out.num_cached_tokens
        history = [p + replies[i] for i, p in enumerate(prompts)]
    return CacheResult(cached_tokens / max(prompt_tokens, 1), gate.min_hit_rate, prompt_tokens, cached_tokens,
                       num_blocks)
