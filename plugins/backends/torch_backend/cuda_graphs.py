"""CUDA graphs of the decode step, one per batch size in a ladder, replayed instead of launching ~10 kernels a layer.

A decode-only step of ``n`` requests runs the smallest captured graph of at least ``n`` rows. The graph reads its
inputs from static device buffers; the host fills a pinned staging buffer laid out as they are and queues one copy
(two for batches whose block tables are large), so the step has no host-device synchronisation (the engine's read
of the sampled tokens is the only one). Padding rows have context length 0, so attention skips them, and write
their K/V into the null block 0, which nothing reads.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Callable

import numpy as np
import torch

from rtx_kernels.decode_attention import choose_num_splits
from rtx_plugins.backends.torch_backend.triton_attention import TritonAttentionMetadata
from rtxcore.contracts.backend import ForwardBatch

if TYPE_CHECKING:
    from torch.cuda import _POOL_HANDLE  # at run time its import is circular (torch's own note)


def batch_size_ladder(max_batch: int) -> list[int]:
    """1, 2, 4, 8, then every multiple of 16 up to ``max_batch`` (padding waste at most 15 rows)."""
    sizes = [s for s in (1, 2, 4, 8) if s < max_batch] + list(range(16, max_batch + 1, 16))
    if not sizes or sizes[-1] < max_batch:
        sizes.append(max_batch)
    return sizes


@contextmanager
def capturing(graph: torch.cuda.CUDAGraph, pool: _POOL_HANDLE | None = None) -> Iterator[None]:
    """``torch.cuda.graph`` as every capture here needs it, in a process that does other CUDA work beside it.

    Thread-local error mode: the KV tiers' worker threads (prefetch reads into pinned memory, which query events) and
    another engine's steps may run while this thread captures; in the default global mode any of their calls
    invalidated the capture ("operation failed due to a previous error during capture", seen on an H200 in
    tests/kv). Garbage collection paused: a finalizer run inside the capture (a pinned tensor's free queries its
    events) would invalidate it from this thread."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
            yield
    finally:
        if enabled:
            gc.enable()


# (input_ids [n], positions [n], metadata) -> logits [n, vocab] float32
ForwardFn = Callable[[torch.Tensor, torch.Tensor, TritonAttentionMetadata], torch.Tensor]


# A graph size's block tables travel in the same copy as its other inputs while its rows of the full table width
# take at most this many bytes (batch 1 to 16 at llama-1b's 256 blocks); larger sizes copy only the step's columns,
# in a second copy.
_FOLDED_TABLE_BYTES = 16384


class DecodeGraphs:
    def __init__(self, forward: ForwardFn, max_batch: int, max_model_len: int, block_size: int, num_kv_heads: int,
                 device: torch.device):
        self.sizes = batch_size_ladder(max_batch)
        self.max_batch = self.sizes[-1]
        self.max_model_len = max_model_len
        self.max_blocks = -(-max_model_len // block_size)
        self._forward = forward
        self._num_kv_heads = num_kv_heads
        n, w = self.max_batch, self.max_blocks
        # Device inputs the graphs read: per size, one int32 buffer that a single copy per step fills (see _Inputs);
        # the block tables of the larger sizes live in one shared buffer.
        self._shared_tables = torch.zeros(n, w, dtype=torch.int32, device=device)
        self._inputs = {size: _Inputs(size, w, device, self._shared_tables) for size in self.sizes}
        # Pinned host twins, two sets used in turn: with asynchronous scheduling the host fills step N+1's while
        # step N's copy may still be queued; by step N+2 the engine has waited for step N's samples, which come after
        # that copy.
        words = max(inputs.words + (0 if inputs.folded else size * w) for size, inputs in self._inputs.items())
        self._staging = [torch.zeros(words, dtype=torch.int32, pin_memory=True) for _ in range(2)]
        self._staging_np = [t.numpy() for t in self._staging]
        self._turn = 0
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._logits: dict[int, torch.Tensor] = {}

    def capture(self) -> None:
        pool = None
        # Largest first, so the smaller graphs fit in the memory pool the largest one reserved.
        for size in reversed(self.sizes):
            inputs = self._inputs[size]
            meta = self._meta(size)
            self._forward(inputs.ids, inputs.pos, meta)  # compiles the kernels, warms the allocator
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with capturing(graph, pool):
                self._logits[size] = self._forward(inputs.ids, inputs.pos, meta)
            pool = graph.pool()
            self._graphs[size] = graph
        torch.cuda.synchronize()

    def _meta(self, size: int) -> TritonAttentionMetadata:
        # The split count is fixed per graph; each split's range follows the row's own context length.
        splits = choose_num_splits(size, self._num_kv_heads, self.max_model_len)
        inputs = self._inputs[size]
        return TritonAttentionMetadata(inputs.slots, size, inputs.tables, inputs.lens, splits)

    def can_run(self, batch: ForwardBatch) -> bool:
        return (batch.write_kv and batch.num_decodes == batch.num_reqs and 0 < batch.num_reqs <= self.max_batch
                and batch.block_tables.shape[1] <= self.max_blocks)

    def run(self, batch: ForwardBatch) -> torch.Tensor:
        n = batch.num_reqs
        size = next(s for s in self.sizes if s >= n)
        inputs = self._inputs[size]
        width = batch.block_tables.shape[1]
        host = self._staging[self._turn]
        h = self._staging_np[self._turn]
        self._turn ^= 1
        # The same layout as the device buffer (see _Inputs), filled through numpy views: ids, positions, slots.
        h64 = h[: 6 * size].view(np.int64)
        ids_on_device = batch.input_ids.is_cuda
        if not ids_on_device:
            h64[:n] = batch.input_ids.numpy()
            h64[n:size] = 0
        h64[size : size + n] = batch.positions.numpy()
        h64[size + n : 2 * size] = 0
        h64[2 * size : 2 * size + n] = batch.slot_mapping.numpy()
        h64[2 * size + n : 3 * size] = 0
        h[6 * size : 6 * size + n] = batch.seq_lens
        h[6 * size + n : 7 * size] = 0
        tables = batch.block_tables.numpy()
        if inputs.folded:
            t = h[7 * size : inputs.words].reshape(size, self.max_blocks)
            t[:n, :width] = tables
            t[n:, :width] = 0
        # One copy for everything but ids that are already on the device (asynchronous scheduling: the previous
        # step's samples) and, for the larger sizes, the block tables.
        first = 2 * size if ids_on_device else 0
        inputs.buffer[first:].copy_(host[first : inputs.words], non_blocking=True)
        if ids_on_device:
            inputs.ids[:n].copy_(batch.input_ids)
        if not inputs.folded:
            staged = host[inputs.words : inputs.words + size * width].view(size, width)
            staged.numpy()[:n] = tables
            staged.numpy()[n:] = 0
            inputs.tables[:, :width].copy_(staged, non_blocking=True)
        self._graphs[size].replay()
        return self._logits[size][:n]


class _Inputs:
    """One graph size's device inputs in one int32 buffer: input ids, positions and slots (int64, two words each),
    context lengths, then the block tables [size, max_blocks] when they are small enough to travel with the rest
    (``folded``); otherwise the tables are rows of a buffer shared by all sizes, filled by a copy of their own."""

    def __init__(self, size: int, max_blocks: int, device: torch.device, shared_tables: torch.Tensor):
        self.folded = size * max_blocks * 4 <= _FOLDED_TABLE_BYTES
        self.words = 7 * size + (size * max_blocks if self.folded else 0)
        self.buffer = torch.zeros(self.words, dtype=torch.int32, device=device)
        wide = self.buffer[: 6 * size].view(torch.int64)
        self.ids, self.pos, self.slots = wide[:size], wide[size : 2 * size], wide[2 * size :]
        self.lens = self.buffer[6 * size : 7 * size]
        if self.folded:
            self.tables = self.buffer[7 * size :].view(size, max_blocks)
        else:
            self.tables = shared_tables[:size]
