"""How the attention kernels read an fp8 KV cache: the dtype their matmuls run in.

An fp8 (e4m3) cache is widened as its tiles load. The GPU converts e4m3 to float16 in one instruction per pair and
to bfloat16 only through float32, and that conversion, not the bytes, then bounded decode attention: at llama-8b's
heads on an H100 (benchmarks/decode_attention_sweep.py, 2026-12-06) 256 requests of 128-256 tokens read an fp8 cache
at 1.45 TB/s against 2.7 TB/s for a bfloat16 one, so halving the bytes saved 15% of the time. A bfloat16 model's
queries are therefore narrowed to float16 (clamped to its range) and the matmuls run in float16 over an fp8 cache:
every e4m3 value is exact in float16, and its 10 mantissa bits keep the queries and probabilities closer than
bfloat16's 7. Other caches keep the query's dtype.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


def dot_dtype(q_dtype: torch.dtype, cache_dtype: torch.dtype) -> tl.dtype:
    """The dtype the attention matmuls take for queries of ``q_dtype`` over a cache of ``cache_dtype``."""
    if cache_dtype.itemsize == 1 and q_dtype == torch.bfloat16:
        return tl.float16
    return {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}[q_dtype]


@triton.jit
def to_dot_dtype(q, DOT_DTYPE: tl.constexpr):
    """``q`` in the matmuls' dtype; narrowing bfloat16 to float16 saturates rather than overflowing to inf."""
    if DOT_DTYPE != q.dtype:
        q = tl.clamp(q.to(tl.float32), -65504.0, 65504.0)  # float16's largest finite value
    return q.to(DOT_DTYPE)
