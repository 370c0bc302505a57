"""The prefill attention's FLOP/s comes from the profiled launches of the Triton kernel in a real prefill (GPU)."""

from __future__ import annotations

import pytest
import torch

from rtxcore.bench.attention_flops import causal_attention_flops, measure_prefill_attention
from rtxcore.bench.workloads import BenchRequest
from tests.helpers.engines import make_engine


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device: the Triton prefill kernel runs there")
def test_measures_every_layers_prefill_launch(registry):
    engine = make_engine("dummy:smollm2-135m", registry=registry, device="cuda", dtype="bfloat16",
                         max_num_batched_tokens=1024, max_model_len=4096)
    # Two prompts of 2,048 tokens: two chunks each, so every layer launches the kernel four times.
    requests = [BenchRequest([100 + (i * 31 + j) % 30000 for j in range(2048)], 1) for i in range(2)]
    result = measure_prefill_attention(engine, requests)
    config = engine.core.model_config
    assert result is not None and result.num_prompts == 2 and result.prompt_tokens == 4096
    assert result.num_launches == 4 * config.num_layers
    assert result.flops == 2 * causal_attention_flops(2048, config.num_layers, config.num_heads, config.head_dim)
    assert 0 < result.kernel_s and result.flops_per_s > 0
