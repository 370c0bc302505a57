"""A grammar's token bitmask applied to logits rows in one launch: forbidden tokens' scores become -inf.

A structured-output step fills one packed bitmask row per logits row on the host (bit ``t % 32`` of word ``t // 32``
set where token ``t`` is allowed, llguidance's layout). Unpacking it with torch ops on the device took seven
launches and a ``[rows, vocab / 8]`` int64 index tensor every step; on a GPU where the default model's decode step is
bound by the host (1.2 ms), each launch is host time the grammar adds to the step (docs/benchmarks.md, "Structured
output against free generation"). Here one kernel reads the packed words and writes -inf where a bit is clear,
touching only the forbidden scores (no load of the logits).

The bitmask rows and, when only some logits rows are masked, their row numbers come in one int32 tensor, so the
caller copies one pinned buffer to the device.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from rtx_kernels.launch import launch

# Columns a program covers: 4,096 scores, 128 words of the mask, so a 49k vocabulary takes 12 programs a row.
_BLOCK = 4096


# Not specialized on the counts (a batch that grows by one would otherwise compile a kernel of its own, for a second,
# on the engine's thread) nor on the rows' offset inside the buffer.
@triton.jit(do_not_specialize=["vocab_size", "num_words", "rows_offset"])
def _apply_bitmask_kernel(logits_ptr, packed_ptr, stride_row, vocab_size, num_words, rows_offset,
                          HAS_ROWS: tl.constexpr, BLOCK: tl.constexpr):
    i = tl.program_id(0)
    if HAS_ROWS:
        row = tl.load(packed_ptr + rows_offset + i).to(tl.int64)
    else:
        row = i.to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    inside = cols < vocab_size
    words = tl.load(packed_ptr + i.to(tl.int64) * num_words + cols // 32, mask=inside, other=-1)
    forbidden = ((words >> (cols % 32)) & 1) == 0
    neg_inf = tl.full([BLOCK], float("-inf"), logits_ptr.dtype.element_ty)
    tl.store(logits_ptr + row * stride_row + cols, neg_inf, mask=inside & forbidden)


def apply_token_bitmask(logits: torch.Tensor, packed: torch.Tensor, num_rows: int, num_words: int,
                        has_rows: bool, cache: dict | None = None) -> None:
    """Set ``logits[row, t]`` to -inf wherever bit ``t`` of the row's mask is clear, in place, queued on the current
    stream.

    ``packed`` is int32 on ``logits``' device: ``num_rows`` mask rows of ``num_words`` words each, then, if
    ``has_rows``, the ``num_rows`` logits rows they apply to (otherwise mask row ``i`` applies to logits row ``i``).
    Columns past ``32 * num_words`` are left as they are. ``cache`` as in :func:`rtx_kernels.launch.launch`.
    """
    if logits.dim() != 2 or logits.stride(1) != 1:
        raise ValueError(f"logits {tuple(logits.shape)} must be 2-D with contiguous rows")
    if packed.dtype != torch.int32 or packed.numel() < num_rows * (num_words + int(has_rows)):
        raise ValueError(f"packed must be int32 with {num_rows} rows of {num_words} words"
                         f"{' and their row numbers' if has_rows else ''}")
    if num_rows == 0:
        return
    vocab_size = min(logits.shape[1], 32 * num_words)
    grid = (num_rows, triton.cdiv(vocab_size, _BLOCK))
    launch(_apply_bitmask_kernel, grid,
           (logits, packed, logits.stride(0), vocab_size, num_words, num_rows * num_words),
           {"HAS_ROWS": has_rows, "BLOCK": _BLOCK}, {"num_warps": 4}, cache)
