"""rtx_kernels.row_copy: rows copied by address land intact, whatever order and allocation they come from, across
tiles and more tiles than programs; on a GPU from pinned host rows to the device and back (the KV tiers' use)."""

from __future__ import annotations

import pytest
import torch

from rtx_kernels.row_copy import can_copy_rows, copy_rows
from tests.helpers.triton import DEVICE, ON_GPU, generator

# Host rows are pinned on a GPU (the device addresses them directly), plain CPU memory under the interpreter.
PIN = ON_GPU


def _rows(num_rows: int, row_bytes: int, seed: int, device: str) -> torch.Tensor:
    gen = generator(seed)
    data = torch.randint(0, 256, (num_rows, row_bytes), dtype=torch.uint8, generator=gen, device=DEVICE)
    if device == "cpu":
        return data.cpu().pin_memory() if PIN else data.cpu()
    return data


def _addrs(rows: list[torch.Tensor]) -> torch.Tensor:
    return torch.tensor([r.data_ptr() for r in rows], dtype=torch.int64, device=DEVICE)


@pytest.mark.parametrize(("num_rows", "row_bytes"), [(5, 3 * 2048 * 8 + 64), (20, 8 * 1000)],
                         ids=["rows-of-several-tiles", "more-tiles-than-programs"])
@pytest.mark.parametrize(("src_on", "dst_on"), [("cpu", DEVICE), (DEVICE, "cpu")], ids=["reload", "spill"])
def test_scattered_rows_land_intact(num_rows, row_bytes, src_on, dst_on):
    buffer = _rows(num_rows + 6, row_bytes, 1, src_on)
    other = _rows(2, row_bytes, 2, src_on)  # a second allocation, as rows read from disk are
    order = torch.randperm(num_rows + 6, generator=torch.Generator().manual_seed(3))[:num_rows - 2].tolist()
    sources = [buffer[i] for i in order] + [other[1], other[0]]
    dest = _rows(num_rows + 3, row_bytes, 4, dst_on)
    untouched = dest[-3:].clone()
    slots = list(range(num_rows))[::-1]  # written in reverse, so no run of rows lines up on both sides
    assert can_copy_rows([t.data_ptr() for t in [*sources, *(dest[s] for s in slots)]], row_bytes)

    copy_rows(_addrs(sources), _addrs([dest[s] for s in slots]), row_bytes)
    if ON_GPU:
        torch.cuda.synchronize()

    for source, slot in zip(sources, slots):
        assert torch.equal(dest[slot].cpu(), source.cpu())
    assert torch.equal(dest[-3:], untouched), "a row past the copied ones was written"


def test_rows_it_cannot_copy_are_refused():
    data = torch.zeros(4, 64, dtype=torch.uint8)
    assert can_copy_rows([data[0].data_ptr(), data[1].data_ptr()], 64)
    assert not can_copy_rows([data[0].data_ptr()], 60), "a row of part of a word"
    assert not can_copy_rows([data[0].data_ptr(), data.view(-1)[4:68].data_ptr()], 64), "off an 8-byte boundary"
