"""Truncation of each row's distribution: top-k, top-p (nucleus) and min-p, every row with its own setting."""

from __future__ import annotations

import torch


def apply_top_k_top_p(
    logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None, max_top_k: int
) -> torch.Tensor:
    """Set to ``-inf`` the logits outside each row's top-k, then outside its nucleus.

    One descending sort serves both filters. Top-p is taken over the distribution left by top-k, renormalized.

    :param logits: float tensor [num_rows, vocab_size].
    :param top_k: long tensor [num_rows], each in ``[1, vocab_size]`` (``vocab_size`` keeps everything); None skips.
    :param top_p: float tensor [num_rows], each in ``(0, 1]`` (1 keeps everything); None skips.
    :param max_top_k: the largest ``top_k`` below ``vocab_size``, known on the host (no sync to find it).
    :returns: the filtered logits (``logits`` itself, or a new tensor).
    """
    if top_p is None and top_k is not None:
        return _apply_top_k(logits, top_k, max_top_k)
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    if top_k is not None:
        kth = sorted_logits.gather(1, (top_k - 1).unsqueeze(1))
        # A threshold rather than a position, so tokens tied with the k-th all stay (as Hugging Face does): which
        # of equal tokens survives must not depend on the sort's tie order.
        sorted_logits.masked_fill_(sorted_logits < kth, float("-inf"))
    if top_p is not None:
        probs = sorted_logits.softmax(dim=-1)
        mass_ahead = probs.cumsum(dim=-1) - probs
        outside = mass_ahead >= top_p.unsqueeze(1)
        # The top token always stays: a top_p below float32's smallest value (1e-300) is 0 in the tensor, and
        # nothing would be left to sample from.
        outside[:, 0] = False
        sorted_logits.masked_fill_(outside, float("-inf"))
    return sorted_logits.scatter(1, order, sorted_logits)


def _apply_top_k(logits: torch.Tensor, top_k: torch.Tensor, max_top_k: int) -> torch.Tensor:
    # Without top-p only each row's k-th largest value matters: a partial top-k is far cheaper than a full sort of
    # a large vocabulary.
    vocab_size = logits.shape[1]
    kth = logits.topk(max_top_k, dim=-1).values.gather(1, (top_k.clamp(max=max_top_k) - 1).unsqueeze(1))
    kth.masked_fill_(top_k.unsqueeze(1) >= vocab_size, float("-inf"))  # rows without top-k keep everything
    return logits.masked_fill_(logits < kth, float("-inf"))


def apply_min_p(probs: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Zero, in place, the probabilities below ``min_p`` times their row's largest (left unnormalized).

    :param probs: float tensor [num_rows, vocab_size].
    :param min_p: float tensor [num_rows] in ``[0, 1]``; 0 keeps everything, and the top token always stays.
    :returns: ``probs``.
    """
    threshold = min_p.unsqueeze(1) * probs.amax(dim=-1, keepdim=True)
    return probs.masked_fill_(probs < threshold, 0.0)
