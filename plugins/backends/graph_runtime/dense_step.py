"""Lay a :class:`ForwardBatch` out as the dense graph's inputs (see ``graph.py``), and write its outputs back.

The flat step (decodes first, then prefill chunks) runs as several graph calls so that little is padded: all
decodes together (one new token each, past padded to the longest), then each prefill chunk on its own. Past K/V are
not copied here: each call names the cache slots of every request's past and the graph gathers them itself.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from rtx_plugins.backends.graph_runtime.graph import MASKED
from rtxcore.contracts.backend import ForwardBatch


@dataclass(slots=True)
class DenseCall:
    # The call's flat token rows in the batch: [first_token, end_token).
    first_token: int
    end_token: int
    # The graph's inputs other than the cache, as numpy arrays.
    feeds: dict[str, np.ndarray]
    # Row of each real new token in the call's flattened [B * T] outputs, in flat batch order.
    token_rows: torch.Tensor
    # Where the call's logits rows go among the batch's ``logits_indices`` (the call may want none: it then
    # computes one row, which is dropped).
    logits_positions: torch.Tensor


def plan_calls(batch: ForwardBatch, dtype: np.dtype) -> list[DenseCall]:
    qsl = batch.query_start_loc
    spans = [(0, batch.num_decodes)] if batch.num_decodes else []
    spans += [(i, i + 1) for i in range(batch.num_decodes, batch.num_reqs)]
    input_ids, positions = batch.input_ids.numpy(), batch.positions.numpy()
    tables = batch.block_tables.numpy()
    wanted = batch.logits_indices.numpy()
    return [_call(lo, hi, qsl, batch.seq_lens, input_ids, positions, tables, batch.block_size, wanted, dtype)
            for lo, hi in spans]


def _call(lo: int, hi: int, qsl: list[int], seq_lens: list[int], input_ids: np.ndarray, positions: np.ndarray,
          block_tables: np.ndarray, block_size: int, wanted: np.ndarray, dtype: np.dtype) -> DenseCall:
    num_new = np.diff(np.asarray(qsl[lo:hi + 1], dtype=np.int64))
    num_past = np.asarray(seq_lens[lo:hi], dtype=np.int64) - num_new
    b, t = hi - lo, int(num_new.max())
    # At least one past column, so no call has an empty axis (the runtimes' handling of those varies).
    p = max(int(num_past.max()), 1)
    req = np.repeat(np.arange(b), num_new)
    offset = np.arange(qsl[hi] - qsl[lo]) - (np.asarray(qsl[lo:hi]) - qsl[lo])[req]
    rows = req * t + offset
    ids = np.zeros(b * t, dtype=np.int64)
    ids[rows] = input_ids[qsl[lo]:qsl[hi]]
    pos = np.zeros(b * t, dtype=np.int64)
    pos[rows] = positions[qsl[lo]:qsl[hi]]

    past = np.arange(p)
    blocks = block_tables[lo:hi, past // block_size].astype(np.int64)
    past_visible = past[None, :] < num_past[:, None]  # [B, P]
    # Masked past columns read slot 0 (the reserved null block): in range, and their scores are discarded.
    slots = np.where(past_visible, blocks * block_size + past % block_size, 0)
    new = np.arange(t)
    new_visible = (new[None, None, :] <= new[None, :, None]) & (new[None, None, :] < num_new[:, None, None])
    visible = np.concatenate([np.broadcast_to(past_visible[:, None, :], (b, t, p)), new_visible], axis=2)
    # float16 cannot hold MASKED: its most negative number masks as well.
    bias = np.where(visible, 0.0, max(MASKED, float(np.finfo(dtype).min))).astype(dtype)
    logits_positions = np.flatnonzero((wanted >= qsl[lo]) & (wanted < qsl[hi]))
    logits_rows = rows[wanted[logits_positions] - qsl[lo]] if len(logits_positions) else rows[:1]
    feeds = {"input_ids": ids.reshape(b, t), "positions": pos.reshape(b, t), "attention_bias": bias,
             "logits_rows": logits_rows, "past_slots": slots}
    return DenseCall(qsl[lo], qsl[hi], feeds, torch.from_numpy(rows), torch.from_numpy(logits_positions))
