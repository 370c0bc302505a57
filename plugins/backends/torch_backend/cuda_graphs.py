"""CUDA graphs of the decode step, one per batch size in a ladder, replayed instead of launching ~10 kernels a layer.

A decode-only step of ``n`` requests runs the smallest captured graph of at least ``n`` rows. The graph reads its
inputs from static device buffers; the host fills pinned staging buffers and queues one copy per input, so the
step has no host-device synchronisation (the engine's read of the sampled tokens is the only one). Padding rows
have context length 0, so attention skips them, and write their K/V into the null block 0, which nothing reads.
"""

from __future__ import annotations

from typing import Callable

import torch

from rtxcore.contracts.backend import ForwardBatch
from rtx_kernels.decode_attention import choose_num_splits
from rtx_plugins.backends.torch_backend.triton_attention import TritonAttentionMetadata


def batch_size_ladder(max_batch: int) -> list[int]:
    """1, 2, 4, 8, then every multiple of 16 up to ``max_batch`` (padding waste at most 15 rows)."""
    sizes = [s for s in (1, 2, 4, 8) if s < max_batch] + list(range(16, max_batch + 1, 16))
    if not sizes or sizes[-1] < max_batch:
        sizes.append(max_batch)
    return sizes


# (input_ids [n], positions [n], metadata) -> logits [n, vocab] float32
ForwardFn = Callable[[torch.Tensor, torch.Tensor, TritonAttentionMetadata], torch.Tensor]


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
        # Device inputs the graphs read, and pinned host twins that each step fills.
        self._ids = torch.zeros(n, dtype=torch.long, device=device)
        self._pos = torch.zeros(n, dtype=torch.long, device=device)
        self._slots = torch.zeros(n, dtype=torch.long, device=device)
        self._lens = torch.zeros(n, dtype=torch.int32, device=device)
        self._tables = torch.zeros(n, w, dtype=torch.int32, device=device)
        # Two sets, used in turn: with asynchronous scheduling the host fills step N+1's while step N's copies may
        # still be queued; by step N+2 the engine has waited for step N's samples, which come after those copies.
        self._staging = [_Staging(n, w) for _ in range(2)]
        self._turn = 0
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._logits: dict[int, torch.Tensor] = {}

    def capture(self) -> None:
        pool = None
        # Largest first, so the smaller graphs fit in the memory pool the largest one reserved.
        for size in reversed(self.sizes):
            meta = self._meta(size)
            self._forward(self._ids[:size], self._pos[:size], meta)  # compiles the kernels, warms the allocator
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self._logits[size] = self._forward(self._ids[:size], self._pos[:size], meta)
            pool = graph.pool()
            self._graphs[size] = graph
        torch.cuda.synchronize()

    def _meta(self, size: int) -> TritonAttentionMetadata:
        # The split count is fixed per graph; each split's range follows the row's own context length.
        splits = choose_num_splits(size, self._num_kv_heads, self.max_model_len)
        return TritonAttentionMetadata(self._slots[:size], size, self._tables[:size], self._lens[:size], splits)

    def can_run(self, batch: ForwardBatch) -> bool:
        return (batch.write_kv and batch.num_decodes == batch.num_reqs and 0 < batch.num_reqs <= self.max_batch
                and batch.block_tables.shape[1] <= self.max_blocks)

    def run(self, batch: ForwardBatch) -> torch.Tensor:
        n = batch.num_reqs
        size = next(s for s in self.sizes if s >= n)
        width = batch.block_tables.shape[1]
        staging = self._staging[self._turn]
        self._turn ^= 1
        host = staging.ids[:, :size]
        host[:, n:] = 0
        if batch.input_ids.is_cuda:
            # Asynchronous scheduling: the ids are the previous step's samples, already on the device.
            self._ids[:n].copy_(batch.input_ids)
        else:
            host[0, :n] = batch.input_ids
        host[1, :n] = batch.positions
        host[2, :n] = batch.slot_mapping
        lens = staging.lens[:size]
        lens[:n] = torch.as_tensor(batch.seq_lens, dtype=torch.int32)
        lens[n:] = 0
        tables = staging.tables[: size * width].view(size, width)
        tables[:n] = batch.block_tables
        tables[n:] = 0
        if not batch.input_ids.is_cuda:
            self._ids[:size].copy_(host[0], non_blocking=True)
        self._pos[:size].copy_(host[1], non_blocking=True)
        self._slots[:size].copy_(host[2], non_blocking=True)
        self._lens[:size].copy_(lens, non_blocking=True)
        self._tables[:size, :width].copy_(tables, non_blocking=True)
        self._graphs[size].replay()
        return self._logits[size][:n]


class _Staging:
    """Pinned host buffers for one step's graph inputs."""

    def __init__(self, max_batch: int, max_blocks: int):
        self.ids = torch.zeros(3, max_batch, dtype=torch.long, pin_memory=True)  # input ids, positions, slots
        self.lens = torch.zeros(max_batch, dtype=torch.int32, pin_memory=True)
        self.tables = torch.zeros(max_batch * max_blocks, dtype=torch.int32, pin_memory=True)
