"""rtx_kernels.token_bitmask: exactly the tokens whose bit is clear become -inf, in the rows named and no others,
whatever the vocabulary's width against the mask's words."""

from __future__ import annotations

import pytest
import torch

from rtx_kernels.token_bitmask import apply_token_bitmask
from tests.helpers.triton import ALL_DTYPES, DEVICE, generator, randn


def _reference(logits: torch.Tensor, words: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """Bit by bit in Python's integers: the meaning of the layout, not a second vectorised implementation."""
    expected = logits.clone().cpu()
    width = min(logits.shape[1], 32 * words.shape[1])
    for i, row in enumerate(rows):
        for token in range(width):
            if not (int(words[i, token // 32]) >> (token % 32)) & 1:
                expected[row, token] = float("-inf")
    return expected


def _packed(words: torch.Tensor, rows: list[int] | None) -> torch.Tensor:
    parts = [words.reshape(-1)] + ([torch.tensor(rows, dtype=torch.int32)] if rows is not None else [])
    return torch.cat(parts).to(DEVICE)


@pytest.mark.parametrize("dtype", ALL_DTYPES)
@pytest.mark.parametrize(("num_logits_rows", "vocab", "rows"), [
    (3, 100, None),             # every row, a vocabulary that ends inside a word
    (6, 4096 + 70, [5, 0, 3]),  # some rows, out of order, a vocabulary over two programs
    (2, 96, [1]),               # logits wider than the mask (padded embeddings): columns past it stay
], ids=["all-rows", "some-rows", "wider-than-mask"])
def test_clear_bits_become_minus_infinity(dtype, num_logits_rows, vocab, rows):
    gen = generator(7)
    logits = randn(num_logits_rows, vocab, gen=gen, dtype=dtype)
    mask_rows = rows if rows is not None else list(range(num_logits_rows))
    num_words = (vocab + 31) // 32 if vocab != 96 else 2  # 64 tokens of mask for 96 columns
    words = torch.randint(-2**31, 2**31, (len(mask_rows), num_words), dtype=torch.int64,
                          generator=torch.Generator().manual_seed(3)).to(torch.int32)
    words[0, 0] = 0  # a word with every token forbidden
    words[-1, -1] = -1  # and one with every token allowed
    expected = _reference(logits, words, mask_rows)

    apply_token_bitmask(logits, _packed(words, rows), len(mask_rows), num_words, rows is not None)

    assert torch.equal(logits.cpu(), expected)
    assert torch.isinf(expected).any() and torch.isfinite(expected).any()


def test_no_rows_is_a_no_op_and_bad_buffers_are_refused():
    logits = torch.zeros(2, 64, device=DEVICE)
    apply_token_bitmask(logits, torch.empty(0, dtype=torch.int32, device=DEVICE), 0, 2, False)
    assert torch.equal(logits, torch.zeros_like(logits))
    with pytest.raises(ValueError, match="int32"):
        apply_token_bitmask(logits, torch.zeros(4, dtype=torch.int64, device=DEVICE), 2, 2, False)
    with pytest.raises(ValueError, match="row numbers"):
        apply_token_bitmask(logits, torch.zeros(4, dtype=torch.int32, device=DEVICE), 2, 2, True)
    with pytest.raises(ValueError, match="contiguous"):
        apply_token_bitmask(logits.t(), torch.zeros(4, dtype=torch.int32, device=DEVICE), 2, 2, False)
