"""Turn the scheduler's decision into the backend's input: flat tokens, positions, block tables, slot mapping."""

from __future__ import annotations

import itertools
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from rtxcore.contracts.backend import ForwardBatch
from rtxcore.contracts.sampler import SamplingBatch
from rtxcore.contracts.scheduler import SchedulerOutput
from rtxcore.request import Request

# Sort key of a prefill: after every decode.
_PREFILL = sys.maxsize


@dataclass(slots=True)
class StepPlan:
    batch: ForwardBatch
    # Requests in batch order with the number of tokens each computes this step.
    reqs: list[Request]
    num_tokens: list[int]
    # Requests that reach the end of their known tokens this step and so sample one (logits row order).
    sampling_reqs: list[Request]
    sampling: SamplingBatch
    # Rows of input_ids whose token is pending, and the row of the previous step's samples that holds it.
    pending_rows: list[int] = field(default_factory=list)
    pending_src: list[int] = field(default_factory=list)
    # Logits rows of each sampling request when some verify proposed tokens (speculative decoding): its last known
    # token's row, then one per proposed token computed; None when every request samples one row (the usual).
    num_rows: list[int] | None = None


def build_step(sched: SchedulerOutput, block_table_of: Callable[[list[str]], np.ndarray], block_size: int,
               generators: dict[str, torch.Generator], pending_reqs: Sequence[Request] = ()) -> StepPlan:
    """:param block_table_of: ``req_ids -> int32 [num_reqs, max_num_blocks]`` block tables (padded with 0) from the
    KV-cache manager.
    :param pending_reqs: the previous step's sampling requests, in row order, when its tokens are still on the
        device (asynchronous scheduling): a request's pending token is the input of one row of this step."""
    # Decodes first, shortest context first: backends attend over them in batches of similar length. Here and in
    # the loop below num_tokens is written out: a property call costs as much as the rest of the work on a request.
    scheduled, counts = sched.scheduled, sched.num_scheduled_tokens
    offsets: list[int] | None = None
    if any(req.spec_token_ids for req in scheduled):
        scheduled, counts, offsets = _split_verifications(scheduled, counts)
    # Sorted stably: the rows of a split verification share their key and stay together, in order.
    keys = [len(req.all_token_ids) + req.num_pending_tokens if n == 1 else _PREFILL
            for req, n in zip(scheduled, counts)]
    order = sorted(range(len(scheduled)), key=keys.__getitem__)
    reqs = [scheduled[i] for i in order]
    counts = [counts[i] for i in order]

    # The only per-request Python: token ids, starts and which rows sample. Per-token work is numpy's.
    starts = [req.num_computed_tokens for req in reqs]
    if offsets is not None:
        offsets = [offsets[i] for i in order]
        starts = [start + max(offset, 0) for start, offset in zip(starts, offsets)]
    input_ids: list[int] = []
    sampling_rows: list[int] = []
    pending_rows: list[int] = []
    pending_src: list[int] = []
    # Keyed by the requests themselves: they hash by identity (eq=False), with no id() call per entry.
    src_row = {req: i for i, req in enumerate(pending_reqs)}
    rows_of: list[int] = []  # logits rows per sampling request
    for row, (req, start, n) in enumerate(zip(reqs, starts, counts)):
        token_ids = req.all_token_ids
        num_known = len(token_ids)
        end = start + n
        if offsets is not None and offsets[row] >= 0:
            # One row of a verification split into single-token rows; the request's last row samples them all.
            input_ids.append(token_ids[start] if start < num_known else req.spec_token_ids[start - num_known])
            if row + 1 == len(reqs) or reqs[row + 1] is not req:
                sampling_rows.append(row)
                rows_of.append(offsets[row] + 1)
            continue
        if req.spec_token_ids and end > num_known:
            # Proposed tokens to verify (no token is pending then: speculation runs the serial step): every
            # position from the last known token on gives a logits row.
            input_ids += (token_ids + req.spec_token_ids)[start:end]
            first = max(start, num_known - 1)
            sampling_rows.append(row)
            rows_of.append(end - first)
            continue
        if end > num_known:
            # The last token was sampled by the previous step and is still on the device: a placeholder here.
            if start < num_known:
                input_ids += token_ids[start:]
            pending_rows.append(len(input_ids))
            pending_src.append(src_row[req])
            input_ids.append(0)
        elif n == 1:
            input_ids.append(token_ids[start])
        else:
            input_ids += token_ids[start:end]
        if end == num_known + req.num_pending_tokens:
            sampling_rows.append(row)
            rows_of.append(1)

    num_reqs, num_tokens, num_decodes = len(reqs), len(input_ids), counts.count(1)
    query_start_loc = list(itertools.accumulate(counts, initial=0))
    if num_decodes == num_reqs:  # decodes only, the usual step: one token per request, at its start
        token_rows = np.arange(num_reqs)
        positions = np.array(starts, dtype=np.int64)
        if offsets is None:
            logits_indices = np.array(sampling_rows, dtype=np.int64)
        else:  # split verifications: every row of one samples
            logits_indices = np.concatenate([np.arange(row + 1 - m, row + 1) for row, m in zip(sampling_rows, rows_of)])
    else:
        token_rows = np.repeat(np.arange(num_reqs), counts)
        positions = np.arange(num_tokens) + np.repeat(np.subtract(starts, query_start_loc[:-1]), counts)
        ends = [query_start_loc[row + 1] for row in sampling_rows]
        if len(rows_of) == sum(rows_of):
            logits_indices = np.array([end - 1 for end in ends], dtype=np.int64)
        else:
            logits_indices = np.concatenate([np.arange(end - m, end) for end, m in zip(ends, rows_of)])
    block_tables = block_table_of([req.req_id for req in reqs])
    slots = block_tables[token_rows, positions // block_size].astype(np.int64) * block_size + positions % block_size
    # Fresh, contiguous host arrays each step: a backend may pin them and copy without blocking, and nothing
    # writes them while such a copy is in flight.
    batch = ForwardBatch(
        input_ids=torch.from_numpy(np.array(input_ids, dtype=np.int64)),
        positions=torch.from_numpy(positions),
        query_start_loc=query_start_loc,
        seq_lens=[start + n for start, n in zip(starts, counts)],
        block_tables=torch.from_numpy(block_tables),
        slot_mapping=torch.from_numpy(slots),
        logits_indices=torch.from_numpy(logits_indices),
        block_size=block_size,
        num_decodes=num_decodes,
    )
    sampling_reqs = [reqs[row] for row in sampling_rows]
    if len(rows_of) == sum(rows_of):
        sampling = SamplingBatch(
            params=[r.params for r in sampling_reqs],
            prompt_token_ids=[r.prompt_token_ids for r in sampling_reqs],
            output_token_ids=[r.output_token_ids for r in sampling_reqs],
            generators=([generators.get(r.req_id) for r in sampling_reqs] if generators
                        else [None] * len(sampling_reqs)),
        )
        return StepPlan(batch, reqs, counts, sampling_reqs, sampling, pending_rows, pending_src)
    return StepPlan(batch, reqs, counts, sampling_reqs, _verification_batch(sampling_reqs, rows_of, generators),
                    pending_rows, pending_src, rows_of)


def _split_verifications(scheduled: list[Request], counts: list[int]
                         ) -> tuple[list[Request], list[int], list[int]]:
    """Each request that only verifies (its last known token and the proposed ones, nothing of its prompt) becomes
    one single-token row per position, every row with the request's block table and its own context length: a
    verification is then a batch of decodes, which backends run from their decode paths (CUDA graphs, the CPU
    decode kernel) instead of as a prefill. Each row sees the earlier rows' K/V, as a forward pass writes every new
    token's K/V of a layer before that layer attends. Returns the rows, their token counts and each split row's
    offset from its request's first computed token (-1 for a row left whole)."""
    reqs: list[Request] = []
    out_counts: list[int] = []
    offsets: list[int] = []
    for req, n in zip(scheduled, counts):
        if n > 1 and req.spec_token_ids and req.num_computed_tokens == len(req.all_token_ids) - 1:
            reqs += [req] * n
            out_counts += [1] * n
            offsets += range(n)
        else:
            reqs.append(req)
            out_counts.append(n)
            offsets.append(-1)
    return reqs, out_counts, offsets


def _verification_batch(reqs: list[Request], rows_of: list[int],
                        generators: dict[str, torch.Generator]) -> SamplingBatch:
    """A request verifying m - 1 proposed tokens samples m rows, each as if the proposed tokens before it had been
    generated: its penalties see them, and a seeded request's generator draws for its rows in order."""
    batch = SamplingBatch([], [], [], [])
    for req, m in zip(reqs, rows_of):
        output = req.output_token_ids
        generator = generators.get(req.req_id)
        for j in range(m):
            batch.params.append(req.params)
            batch.prompt_token_ids.append(req.prompt_token_ids)
            batch.output_token_ids.append(output + req.spec_token_ids[:j] if j else output)
            batch.generators.append(generator)
    return batch


def build_embedding_batch(token_lists: list[list[int]], block_size: int) -> ForwardBatch:
    """Whole prompts, no cache: each attends causally to itself only."""
    lengths = [len(ids) for ids in token_lists]
    starts = [0]
    for n in lengths:
        starts.append(starts[-1] + n)
    return ForwardBatch(
        input_ids=torch.tensor([t for ids in token_lists for t in ids], dtype=torch.long),
        positions=torch.tensor([p for n in lengths for p in range(n)], dtype=torch.long),
        query_start_loc=starts,
        seq_lens=lengths,
        block_tables=torch.zeros((len(lengths), 1), dtype=torch.int32),
        slot_mapping=torch.empty(0, dtype=torch.long),
        logits_indices=torch.empty(0, dtype=torch.long),
        block_size=block_size,
        num_decodes=0,
        write_kv=False,
    )
