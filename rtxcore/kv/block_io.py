"""Copying whole KV blocks between a backend's cache tensors and the host, for backends that keep their cache as
torch tensors with one dimension indexed by block id (the layout varies; the block dimension is what they share).

A block's bytes are each tensor's slice for that block, flattened, one tensor after another: an opaque record that
only the same backend, with the same model, dtype and block size, reads back.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from rtxcore.transfer import to_device


def read_blocks(caches: Sequence[torch.Tensor], block_dim: int, block_ids: list[int]) -> torch.Tensor:
    """uint8 [len(block_ids), block_bytes] on the caches' device.

    Queued after every kernel already queued on that device's stream, so the bytes are what the last step wrote;
    nothing waits for the GPU here (the host tier copies them out asynchronously).
    """
    caches = _copyable(caches)
    device, n = caches[0].device, len(block_ids)
    # From pinned memory: a blocking copy from pageable memory would wait for the step in flight.
    ids = to_device(block_ids, torch.long, device)
    out = torch.empty(n, sum(t.numel() // t.shape[block_dim] for t in caches), dtype=caches[0].dtype,
                      device=device)
    start = 0
    for t in caches:
        shape = t.shape[:block_dim] + t.shape[block_dim + 1:]
        size = t.numel() // t.shape[block_dim]
        # Gathered straight into the block-major buffer: one copy fewer than gathering and concatenating.
        out[:, start:start + size].view(n, *shape).copy_(t.index_select(block_dim, ids).movedim(block_dim, 0))
        start += size
    return out.view(torch.uint8)


def write_blocks(caches: Sequence[torch.Tensor], block_dim: int, block_ids: list[int], data: torch.Tensor) -> None:
    """Put bytes :func:`read_blocks` returned for the same caches into ``block_ids``."""
    caches = _copyable(caches)
    device, dtype = caches[0].device, caches[0].dtype
    n = len(block_ids)
    values = data.view(dtype).reshape(n, -1)
    expected = sum(t.numel() // t.shape[block_dim] for t in caches)
    if values.shape[1] != expected:
        raise ValueError(f"KV block data has {values.shape[1]} values per block, the cache {expected}")
    values = values.to(device, non_blocking=True)
    ids = to_device(block_ids, torch.long, device)
    start = 0
    for t in caches:
        shape = t.shape[:block_dim] + t.shape[block_dim + 1:]
        size = t.numel() // t.shape[block_dim]
        t.index_copy_(block_dim, ids, values[:, start:start + size].reshape(n, *shape).movedim(0, block_dim))
        start += size


def _copyable(caches: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """The caches as they are copied: fp8 ones as uint8 (the same bytes), since torch's CPU index_select and
    index_copy_ take no fp8; wider dtypes as they are, copied element by element rather than byte by byte."""
    return [t.view(torch.uint8) if t.dtype.itemsize == 1 else t for t in caches]
