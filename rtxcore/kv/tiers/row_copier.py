"""One launch for a batch of KV block rows between the GPU and pinned host memory, however the rows lie.

Copy engines move one contiguous range per ``copy_``, so rows in scattered host slots cost one torch call each run
of adjacent slots; every such call releases the GIL and must win it back from the serving thread, which is what a
reload or a spill cost the engine's thread on the H200 (docs/benchmarks.md). :func:`rtx_kernels.row_copy.copy_rows`
reads and writes pinned host memory from the GPU directly, one launch per batch. Where it cannot run (no Triton,
no GPU, ``RTX_KV_ROW_COPY=0``, an unaligned row) :meth:`RowCopier.copy` says so and the caller copies runs itself.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Sequence
from functools import cache

import torch

from rtxcore import envs
from rtxcore.transfer import to_device

log = logging.getLogger("rtx.kv")


@cache
def _kernel():
    """``(copy_rows, can_copy_rows)``, or None without Triton or with ``RTX_KV_ROW_COPY=0``."""
    if not envs.RTX_KV_ROW_COPY.get():
        return None
    try:
        from rtx_kernels.row_copy import can_copy_rows, copy_rows
    except ImportError:  # Triton missing: the copies go through the copy engines
        return None
    return copy_rows, can_copy_rows


class RowCopier:
    """Copies on one GPU, queued on the current stream. No allocator knows when the kernel has used a host row, so
    each copy's host tensors are held (with an event after the copy) until the device is past it: pinned rows read
    from disk would otherwise go back to torch's pinned-memory cache, and into another tensor, while still being
    read. Device memory needs no such care: its reuse is ordered on the stream."""

    def __init__(self, device: torch.device, host_pinned: bool = True):
        """``host_pinned``: whether the host rows the caller will pass are in pinned memory (the GPU cannot
        address pageable memory; the caller knows, where checking each row would cost a call per row)."""
        self.device = device
        self._launches: dict = {}
        self._held: deque[tuple[torch.cuda.Event, list[torch.Tensor]]] = deque()
        self._kernel = _kernel() if device.type == "cuda" and host_pinned else None
        if self._kernel is not None:
            # Compiled now, not at the first spill: that would hold the engine's thread for a second mid-serving.
            probe = torch.zeros(4, 8, dtype=torch.uint8, device=device)
            addrs = to_device([[probe[0].data_ptr(), probe[1].data_ptr()], [probe[2].data_ptr(), probe[3].data_ptr()]],
                              torch.int64, device)
            try:
                self._kernel[0](addrs[0], addrs[1], 8, self._launches)
            except Exception as exc:  # Triton cannot build for this GPU (a GPU test checks it builds there)
                log.warning("KV tier copies go through the copy engines, the row-copy kernel failed to build: %s", exc)
                self._kernel = None

    @property
    def available(self) -> bool:
        return self._kernel is not None

    def copy(self, src_addrs: list[int], dst_addrs: list[int], row_bytes: int, hold: Sequence[torch.Tensor]) -> bool:
        """Copy ``row_bytes`` from each source address to the destination beside it; ``hold``: the host tensors
        those addresses lie in, kept until the copy has run. False, with nothing queued, where the kernel cannot do
        it. Addresses, not tensors: a view per row would cost the engine's thread a torch call each."""
        if self._kernel is None or not src_addrs:
            return False
        copy_rows, can_copy_rows = self._kernel
        if not can_copy_rows(src_addrs + dst_addrs, row_bytes):
            return False
        addrs = to_device([src_addrs, dst_addrs], torch.int64, self.device)
        copy_rows(addrs[0], addrs[1], row_bytes, self._launches)
        event = torch.cuda.Event()
        event.record()
        self.release_copied()
        self._held.append((event, list(hold)))
        return True

    def release_copied(self) -> None:
        """Let go of the host memory of copies the device has run (called each step: a reload's staging rows can
        be hundreds of MiB)."""
        while self._held and self._held[0][0].query():
            self._held.popleft()
