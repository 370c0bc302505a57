"""The fused C++ decode attention equals the pure-torch paged attention it replaces."""

from __future__ import annotations

import pytest
import torch

from rtx_kernels.cpu_ops import paged_decode_kernel
from rtx_plugins.backends.torch_backend.attention import _decode


@pytest.fixture(scope="module")
def kernel():
    k = paged_decode_kernel()
    assert k is not None, "the CPU kernel must build here (g++ and ninja are part of the set-up)"
    return k


@pytest.mark.parametrize("batch, heads, kv_heads, block_size", [(1, 4, 4, 16), (7, 9, 3, 16), (33, 8, 2, 8)])
def test_fused_decode_matches_torch_reference(kernel, batch, heads, kv_heads, block_size):
    gen = torch.Generator().manual_seed(batch)
    num_blocks, d = 64, 32
    k_cache = torch.randn(kv_heads, num_blocks, block_size, d, generator=gen)
    v_cache = torch.randn(kv_heads, num_blocks, block_size, d, generator=gen)
    lens = torch.randint(1, 6 * block_size, (batch,), generator=gen)
    width = -(-int(lens.max()) // block_size)
    tables = torch.stack([torch.randperm(num_blocks - 1, generator=gen)[:width] + 1 for _ in range(batch)])
    q = torch.randn(batch, heads, d, generator=gen)
    mask = torch.arange(width * block_size)[None, :] < lens[:, None]
    expected = _decode(q, k_cache, v_cache, tables, mask, 0.17)
    got = kernel(q, k_cache, v_cache, tables, lens, 0.17)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
