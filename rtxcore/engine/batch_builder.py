"""Turn the scheduler's decision into the backend's input: flat tokens, positions, block tables, slot mapping."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rtxcore.contracts.backend import ForwardBatch
from rtxcore.contracts.sampler import SamplingBatch
from rtxcore.contracts.scheduler import SchedulerOutput
from rtxcore.request import Request


@dataclass(slots=True)
class StepPlan:
    batch: ForwardBatch
    # Requests in batch order with the number of tokens each computes this step.
    reqs: list[Request]
    num_tokens: list[int]
    # Requests that reach the end of their known tokens this step and so sample one (logits row order).
    sampling_reqs: list[Request]
    sampling: SamplingBatch


def build_step(sched: SchedulerOutput, block_ids_of, block_size: int,
               generators: dict[str, torch.Generator]) -> StepPlan:
    """:param block_ids_of: ``req_id -> list[int]`` from the KV-cache manager."""
    # Decodes first, shortest context first: backends attend over them in batches of similar length.
    scheduled, counts = sched.scheduled, sched.num_scheduled_tokens
    order = sorted(range(len(scheduled)), key=lambda i: (counts[i] != 1, scheduled[i].num_tokens if counts[i] == 1 else 0))
    reqs = [sched.scheduled[i] for i in order]
    counts = [counts[i] for i in order]

    input_ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    query_start_loc = [0]
    seq_lens: list[int] = []
    tables: list[list[int]] = []
    logits_indices: list[int] = []
    sampling_reqs: list[Request] = []
    for req, n in zip(reqs, counts):
        start = req.num_computed_tokens
        end = start + n
        blocks = block_ids_of(req.req_id)
        input_ids.extend(req.all_token_ids[start:end])
        positions.extend(range(start, end))
        slots.extend(blocks[p // block_size] * block_size + p % block_size for p in range(start, end))
        query_start_loc.append(query_start_loc[-1] + n)
        seq_lens.append(end)
        tables.append(blocks)
        if end == req.num_tokens:
            logits_indices.append(query_start_loc[-1] - 1)
            sampling_reqs.append(req)

    width = max(len(t) for t in tables)
    block_tables = torch.zeros((len(tables), width), dtype=torch.int32)
    for row, t in enumerate(tables):
        block_tables[row, : len(t)] = torch.tensor(t, dtype=torch.int32)
    batch = ForwardBatch(
        input_ids=torch.tensor(input_ids, dtype=torch.long),
        positions=torch.tensor(positions, dtype=torch.long),
        query_start_loc=query_start_loc,
        seq_lens=seq_lens,
        block_tables=block_tables,
        slot_mapping=torch.tensor(slots, dtype=torch.long),
        logits_indices=torch.tensor(logits_indices, dtype=torch.long),
        block_size=block_size,
        num_decodes=sum(1 for n in counts if n == 1),
    )
    sampling = SamplingBatch(
        params=[r.params for r in sampling_reqs],
        prompt_token_ids=[r.prompt_token_ids for r in sampling_reqs],
        output_token_ids=[r.output_token_ids for r in sampling_reqs],
        generators=[generators.get(r.req_id) for r in sampling_reqs],
    )
    return StepPlan(batch, reqs, counts, sampling_reqs, sampling)


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
