"""Shared set-up of the Triton kernel tests: where they run and seeded random inputs.

Without a GPU the kernels run under Triton's interpreter (conftest sets TRITON_INTERPRET=1) on small shapes; on a
CUDA machine the same tests run compiled, on serving-sized shapes. Importing this module skips the importing test
module where neither can run.
"""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("triton")

ON_GPU = os.environ.get("TRITON_INTERPRET") != "1"
if ON_GPU and not torch.cuda.is_available():
    pytest.skip("compiled Triton needs CUDA; set TRITON_INTERPRET=1 to use the interpreter", allow_module_level=True)
DEVICE = "cuda" if ON_GPU else "cpu"
ALL_DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def generator(seed: int) -> torch.Generator:
    return torch.Generator(device=DEVICE).manual_seed(seed)


def randn(*shape, gen, dtype=torch.float32) -> torch.Tensor:
    return torch.randn(*shape, generator=gen, device=DEVICE).to(dtype)


def paged_cache(seq_lens: list[int], num_kv_heads: int, block_size: int, head_size: int, dtype, gen):
    """Random K/V caches ``[KVH, blocks, bs, D]`` of ``dtype`` (fp8 included) and int32 block tables with shuffled,
    out-of-order block ids.

    Slots no request owns hold NaN, block 0 (the null block) included, and tables are padded past their need.
    """
    needed = [-(-s // block_size) for s in seq_lens]
    num_blocks = 1 + sum(needed) + 3
    order = torch.randperm(num_blocks - 1, generator=gen, device=DEVICE) + 1
    max_blocks = max(needed, default=0) + 2
    block_tables = torch.zeros(len(seq_lens), max_blocks, dtype=torch.int32, device=DEVICE)
    owned = torch.zeros(num_blocks, block_size, dtype=torch.bool, device=DEVICE)
    used = 0
    for r, (seq_len, n) in enumerate(zip(seq_lens, needed)):
        ids = order[used : used + n]
        used += n
        block_tables[r, :n] = ids.int()
        owned[ids] = True
        if seq_len % block_size:
            owned[ids[-1], seq_len % block_size :] = False
    caches = []
    for _ in range(2):
        cache = randn(num_kv_heads, num_blocks, block_size, head_size, gen=gen)
        cache[:, ~owned] = float("nan")
        caches.append(cache.to(dtype))  # NaN stays NaN in fp8 (e4m3fn has one)
    return caches[0], caches[1], block_tables
