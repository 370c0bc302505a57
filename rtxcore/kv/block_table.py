"""Every request's block ids as one row of a single int32 array, kept current as blocks are added.

A step's block table is then one gather of its requests' rows instead of a Python copy of every id of every request:
tables change only when a request crosses a block boundary, while they are read every step.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from rtxcore.kv.block_pool import NULL_BLOCK_ID, BlockPoolError


class BlockTable:
    """Rows of block ids padded with the null block (0); row 0 is never handed out and stays empty."""

    # The row of a request that holds no block.
    EMPTY_ROW = 0

    def __init__(self, num_rows: int = 16, num_cols: int = 16):
        self._table = np.full((max(num_rows, 2), max(num_cols, 1)), NULL_BLOCK_ID, dtype=np.int32)
        # Blocks in each row: the width a gather needs is their maximum over the rows gathered.
        self._num_blocks = np.zeros(len(self._table), dtype=np.int64)
        # Popped from the end: low rows first.
        self._free_rows = list(range(len(self._table) - 1, 0, -1))

    def add_row(self) -> int:
        if not self._free_rows:
            num_rows = len(self._table)
            self._table = np.concatenate([self._table, np.full_like(self._table, NULL_BLOCK_ID)])
            self._num_blocks = np.concatenate([self._num_blocks, np.zeros_like(self._num_blocks)])
            self._free_rows = list(range(2 * num_rows - 1, num_rows - 1, -1))
        return self._free_rows.pop()

    def append(self, row: int, start: int, block_ids: Sequence[int]) -> None:
        """Set columns ``[start, start + len(block_ids))`` of ``row``, its first ``start`` being set already."""
        end = start + len(block_ids)
        num_cols = self._table.shape[1]
        if end > num_cols:
            while num_cols < end:
                num_cols *= 2
            wider = np.full((len(self._table), num_cols), NULL_BLOCK_ID, dtype=np.int32)
            wider[:, : self._table.shape[1]] = self._table
            self._table = wider
        self._table[row, start:end] = block_ids
        self._num_blocks[row] = end

    def free_row(self, row: int) -> None:
        """Clear the row and make it available again."""
        self._table[row, : self._num_blocks[row]] = NULL_BLOCK_ID
        self._num_blocks[row] = 0
        self._free_rows.append(row)

    def gather(self, rows: Sequence[int]) -> np.ndarray:
        """A new C-contiguous array [len(rows), most blocks in any of them] holding those rows."""
        index = np.array(rows, dtype=np.intp)
        num_cols = int(self._num_blocks[index].max()) if len(index) else 0
        return self._table[index, :num_cols]

    def check_invariants(self, rows: dict[int, list[int]]) -> None:
        """:param rows: every row in use with the block ids it must hold.

        :raises BlockPoolError: naming the first row that differs, or one neither in use nor free.
        """
        expected = np.zeros_like(self._table)
        for row, block_ids in rows.items():
            if row == self.EMPTY_ROW or row in self._free_rows:
                raise BlockPoolError(f"block table row {row} is in use but reserved or free")
            expected[row, : len(block_ids)] = block_ids
            if self._num_blocks[row] != len(block_ids):
                raise BlockPoolError(f"block table row {row} counts {self._num_blocks[row]} blocks, "
                                     f"not {len(block_ids)}")
        for bad_row in np.flatnonzero((self._table != expected).any(axis=1)):
            raise BlockPoolError(f"block table row {bad_row} is {self._table[bad_row].tolist()}, "
                                 f"expected {expected[bad_row].tolist()}")
        if len(rows) + len(self._free_rows) + 1 != len(self._table):
            raise BlockPoolError("a block table row is lost or both free and in use")
