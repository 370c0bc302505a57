"""The cache gate: prefix-cache hit rate on a steady multi-turn workload (W4 of docs/workloads.md, scaled down).

Conversations run side by side; each turn's prompt is the conversation so far (earlier prompts and the model's
replies) plus new tokens, so everything but the new tokens and the last partial block could come from the cache.

The gate runs the workload with a device cache that holds every conversation, and again with one too small for
them (fewer run at once) but a host-memory tier under it: both must reach the rate. The small cache without the
host tier runs too, for comparison.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from rtx_conformance.gates.config import CacheGate
from rtx_conformance.gates.latency import engine_for
from rtxcore.contracts.scheduler import SchedulerConfig
from rtxcore.engine.llm import LLM
from rtxcore.registry import ComponentRecord, PluginRegistry
from rtxcore.sampling_params import SamplingParams


@dataclass(frozen=True, slots=True)
class CacheResult:
    # Device cache with room for every conversation.
    hit_rate: float
    min_hit_rate: float
    num_prompt_tokens: int
    num_cached_tokens: int
    num_kv_blocks: int
    # Device cache too small for every conversation, with a host tier under it: the rate the lower tiers keep.
    tiered_hit_rate: float
    tiered_kv_blocks: int
    # The same small device cache without the host tier, for comparison (not gated).
    no_offload_hit_rate: float

    @property
    def passed(self) -> bool:
        return self.hit_rate >= self.min_hit_rate and self.tiered_hit_rate >= self.min_hit_rate


def run_cache(gate: CacheGate, record: ComponentRecord, registry: PluginRegistry) -> CacheResult:
    longest = gate.num_turns * (gate.max_new_tokens + gate.output_len)
    blocks_per_conversation = -(-longest // gate.block_size)
    all_blocks = gate.num_conversations * blocks_per_conversation

    def engine(num_blocks: int, max_num_seqs: int, **tiers) -> LLM:
        return engine_for(record, registry, gate.model, block_size=gate.block_size, num_kv_blocks=num_blocks,
                          max_model_len=longest + gate.block_size,
                          scheduling=SchedulerConfig(max_num_seqs=max_num_seqs), **tiers)

    roomy_blocks = int(gate.kv_blocks_factor * all_blocks) + 1
    roomy = engine(roomy_blocks, gate.num_conversations)
    prompt_tokens, cached_tokens = run_turns(roomy, gate)
    block_bytes = roomy.core.backend.kv_cache_bytes_per_token() * gate.block_size
    small_blocks = int(gate.tiered_kv_blocks_factor * all_blocks) + 1
    host_bytes = int(gate.tiered_host_blocks_factor * all_blocks) * block_bytes
    tiered = run_turns(engine(small_blocks, gate.tiered_max_num_seqs, kv_host_bytes=host_bytes), gate)
    no_offload = run_turns(engine(small_blocks, gate.tiered_max_num_seqs), gate)
    return CacheResult(cached_tokens / max(prompt_tokens, 1), gate.min_hit_rate, prompt_tokens, cached_tokens,
                       roomy_blocks, _rate(tiered), small_blocks, _rate(no_offload))


def run_turns(engine: LLM, gate: CacheGate) -> tuple[int, int]:
    """Run every turn of every conversation; returns (prompt tokens, of those cached) over turns 2..num_turns."""
    rng = random.Random(gate.seed)
    vocab = engine.core.model_config.vocab_size
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
    return prompt_tokens, cached_tokens


def _rate(counts: tuple[int, int]) -> float:
    return counts[1] / max(counts[0], 1)
