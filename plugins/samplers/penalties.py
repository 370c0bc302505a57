"""Repetition (Hugging Face) and presence / frequency (OpenAI) penalties over a whole batch of logits rows."""

from __future__ import annotations

import itertools

import numpy as np
import torch

from rtxcore.contracts import SamplingBatch
from rtxcore.transfer import to_device, to_device_async


def apply_penalties(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Penalize tokens already seen, every row with its own settings.

    Repetition first (tokens of prompt or output: positive logits divided by the penalty, negative multiplied), then
    presence and frequency over output tokens only: ``logit -= presence * (count > 0) + frequency * count``.

    :param logits: float tensor [num_rows, vocab_size].
    :param batch: the rows' options and token histories.
    :returns: the penalized logits, a new tensor.
    """
    vocab_size = logits.shape[1]
    device = logits.device
    # Rows without penalties contribute no tokens, so their histories are never copied to the device.
    output_ids = [ids if p.needs_output_history else [] for ids, p in zip(batch.output_token_ids, batch.params)]
    output_counts = token_counts(output_ids, vocab_size, device, logits.dtype)
    output_seen = output_counts > 0

    if any(p.repetition_penalty != 1 for p in batch.params):
        prompt_ids = [ids if p.repetition_penalty != 1 else [] for ids, p in zip(batch.prompt_token_ids, batch.params)]
        seen = output_seen | (token_counts(prompt_ids, vocab_size, device, logits.dtype) > 0)
        penalty = to_device([p.repetition_penalty for p in batch.params], logits.dtype, device).unsqueeze(1)
        penalized = torch.where(logits < 0, logits * penalty, logits / penalty)
        logits = torch.where(seen, penalized, logits)

    if any(p.presence_penalty != 0 or p.frequency_penalty != 0 for p in batch.params):
        weights = to_device([[p.presence_penalty, p.frequency_penalty] for p in batch.params], logits.dtype, device)
        presence, frequency = weights[:, 0:1], weights[:, 1:2]
        logits = logits - presence * output_seen - frequency * output_counts
    return logits


def token_counts(
    token_ids: list[list[int]], vocab_size: int, device: torch.device, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """How often each token occurs in each row.

    :param token_ids: one list of non-negative token ids per row; ids from ``vocab_size`` up are not counted.
    :returns: tensor [num_rows, vocab_size] of ``dtype`` on ``device``.
    """
    num_rows, width = len(token_ids), vocab_size + 1
    # The histories come as Python lists every step; numpy reads them about ten times faster than torch.tensor.
    lengths = np.fromiter((len(ids) for ids in token_ids), dtype=np.int64, count=num_rows)
    flat = np.fromiter(itertools.chain.from_iterable(token_ids), dtype=np.int64, count=int(lengths.sum()))
    # Ids beyond the logits (embedding tables padded past the output vocabulary) cannot be emitted: they land in an
    # extra column that is cut off, as in Hugging Face's RepetitionPenaltyLogitsProcessor.
    np.minimum(flat, vocab_size, out=flat)
    flat += np.repeat(np.arange(num_rows, dtype=np.int64) * width, lengths)
    index = to_device_async(torch.from_numpy(flat), device)  # one host-to-device copy for the whole batch
    counts = torch.zeros(num_rows, width, dtype=dtype, device=device)
    counts.view(-1).scatter_add_(0, index, torch.ones(index.shape, dtype=dtype, device=device))
    return counts[:, :vocab_size]
