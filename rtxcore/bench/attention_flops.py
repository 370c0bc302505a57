"""The prefill attention's achieved FLOP/s in a real run (W7): the device time of its kernel under the torch profiler,
against the useful FLOPs of the prompts it prefilled.

Useful FLOPs count only the (query, key) pairs causality lets through, ``L (L + 1) / 2`` per head for a prompt of
``L`` tokens, as flash-attention's own figures do: the masked halves of diagonal tiles are work the kernel does but
not work the model asks for.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rtxcore.bench.engine import Engine, drain
from rtxcore.bench.workloads import BenchRequest
from rtxcore.sampling_params import SamplingParams

# Dense bf16 tensor-core peak of one H200 (NVIDIA's datasheet, without sparsity); shared/ENVIRONMENT.md measured
# about 790 TFLOP/s for a large bf16 matmul there.
H200_BF16_PEAK_FLOPS = 989.4e12
# The Triton kernel of rtx_kernels.prefill_attention, as the profiler names it (its Python function's name).
PREFILL_KERNEL = "_prefill_kernel"


@dataclass(frozen=True, slots=True)
class PrefillAttentionResult:
    num_prompts: int
    prompt_tokens: int
    flops: float  # useful (causal) FLOPs of every layer's prefill attention over these prompts
    kernel_s: float  # the device time of the prefill attention kernel's launches
    num_launches: int

    @property
    def flops_per_s(self) -> float:
        return self.flops / self.kernel_s

    def line(self) -> str:
        return (f"prefill attention: {self.flops_per_s / 1e12:.1f} TFLOP/s achieved over {self.num_prompts} prompts "
                f"({self.prompt_tokens} tokens, {self.num_launches} launches, {self.kernel_s * 1e3:.1f} ms), "
                f"{self.flops_per_s / H200_BF16_PEAK_FLOPS:.1%} of the H200's dense bf16 peak")

    def to_json(self) -> dict:
        return {"num_prompts": self.num_prompts, "prompt_tokens": self.prompt_tokens, "flops": self.flops,
                "kernel_s": self.kernel_s, "num_launches": self.num_launches, "flops_per_s": self.flops_per_s,
                "fraction_of_h200_bf16_peak": self.flops_per_s / H200_BF16_PEAK_FLOPS}


def causal_attention_flops(prompt_len: int, num_layers: int, num_heads: int, head_size: int,
                           context_len: int = 0) -> float:
    """Two matmuls (Q K^T, then P V), two FLOPs per multiply-add, over each head's visible (query, key) pairs: a
    chunk of ``prompt_len`` queries after ``context_len`` cached tokens sees the whole context and its own causal
    triangle."""
    pairs = prompt_len * context_len + prompt_len * (prompt_len + 1) / 2
    return 4.0 * num_layers * num_heads * head_size * pairs


def measure_prefill_attention(engine: Engine, requests: list[BenchRequest],
                              max_prompts: int = 4) -> PrefillAttentionResult | None:
    """Prefill up to ``max_prompts`` of ``requests`` (one token out each) under the profiler. None where it cannot
    be measured: off CUDA, when the backend runs attention without the Triton kernel (``RTX_TORCH_KERNELS=torch``,
    no Triton), and across several ranks (this process sees only its own share of the heads and layers)."""
    if engine.core.backend.device.type != "cuda" or engine.core.config.world_size > 1:
        return None
    chosen = requests[:max_prompts]
    engine.core.kv_cache.reset_prefix_cache()  # every prompt token is computed, none reused
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as profiler:
        drain(engine, ((r.prompt_token_ids, params) for r in chosen))
        torch.cuda.synchronize()
    kernels = [e for e in profiler.key_averages() if PREFILL_KERNEL in e.key]
    if not kernels:
        return None
    config = engine.core.model_config
    flops = sum(causal_attention_flops(len(r.prompt_token_ids), config.num_layers, config.num_heads, config.head_dim)
                for r in chosen)
    kernel_us = sum(e.device_time_total for e in kernels)
    return PrefillAttentionResult(len(chosen), sum(len(r.prompt_token_ids) for r in chosen), flops, kernel_us / 1e6,
                                  sum(e.count for e in kernels))
