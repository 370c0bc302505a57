"""Copying rows of bytes between scattered addresses in one launch, with host memory on either side.

The KV tiers move blocks between the device and a pinned host buffer. A reload's blocks lie in scattered slots of
that buffer (or in pinned rows read from disk), and a spill's go to scattered free slots, so copy engines would
need one ``copy_`` per run of adjacent rows: on the H200 a reload of a 2k-token history made 21 of them, each a
torch call that releases the GIL and has to win it back from the serving thread (docs/benchmarks.md, "W4 with KV
tiers on the H200"). A GPU addresses pinned host memory directly (unified virtual addressing), so one kernel
reads or writes every row whatever its address, and the engine's thread makes one launch per reload or spill.

Rows are given by address, one int64 per row on each side, so that any pinned tensor, buffer slot or device row
can be a source or a destination. The grid is small on purpose: the copy runs beside the steps (reloads on a copy
stream), and each program keeps enough loads in flight to cover the PCIe latency without taking the SMs the steps
need.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from rtx_kernels.launch import launch

# Bytes each program moves per loop turn (as int64 words): with 4 warps, 16 words a thread in flight.
_TILE_WORDS = 2048
# Programs of one launch: on the H200, 16 moved a reload alone as fast as 32, 64 or 132 did (47 GB/s,
# benchmarks/row_copy.py), and take the fewest SMs from the steps beside them.
_MAX_PROGRAMS = 16


# Not specialized on the counts, nor on where the address tables lie (one load per tile reads them): a spill of one
# row, or an odd count that leaves the second table off 16 bytes, would otherwise compile a kernel of its own, for
# a second, on the engine's thread.
@triton.jit(do_not_specialize=["num_rows", "row_words"],
            do_not_specialize_on_alignment=["src_addr_ptr", "dst_addr_ptr"])
def _copy_rows_kernel(src_addr_ptr, dst_addr_ptr, num_rows, row_words, TILE: tl.constexpr):
    tiles_per_row = tl.cdiv(row_words, TILE)
    num_tiles = num_rows * tiles_per_row
    for tile in range(tl.program_id(0), num_tiles, tl.num_programs(0)):
        row = tile // tiles_per_row
        offs = (tile % tiles_per_row) * TILE + tl.arange(0, TILE)
        mask = offs < row_words
        src = tl.load(src_addr_ptr + row).to(tl.pointer_type(tl.int64))
        dst = tl.load(dst_addr_ptr + row).to(tl.pointer_type(tl.int64))
        tl.store(dst + offs, tl.load(src + offs, mask=mask), mask=mask)


def can_copy_rows(addrs: list[int], row_bytes: int) -> bool:
    """Whether :func:`copy_rows` may move rows of ``row_bytes`` from or to these addresses: it copies whole 8-byte
    words from 8-byte aligned addresses."""
    return row_bytes % 8 == 0 and not any(a & 7 for a in addrs)


def copy_rows(src_addrs: torch.Tensor, dst_addrs: torch.Tensor, row_bytes: int, cache: dict | None = None,
              num_programs: int = _MAX_PROGRAMS) -> None:
    """Copy ``row_bytes`` bytes from each address in ``src_addrs`` to the one beside it in ``dst_addrs`` (int64
    tensors on the device that runs the copy), queued on the current stream. Every address must be one that device
    can reach (its own memory, or pinned host memory) and 8-byte aligned (:func:`can_copy_rows`); the memory must
    stay allocated until the copy has run, which no allocator knows here: the caller holds on to it.
    ``num_programs`` bounds the grid (for measurements; see _MAX_PROGRAMS for the default)."""
    num_rows = src_addrs.numel()
    if num_rows == 0:
        return
    row_words = row_bytes // 8
    grid = (min(num_programs, num_rows * triton.cdiv(row_words, _TILE_WORDS)),)
    launch(_copy_rows_kernel, grid, (src_addrs, dst_addrs, num_rows, row_words), {"TILE": _TILE_WORDS},
           {"num_warps": 4}, cache)
