"""build_step: the batch layout backends rely on, checked against a plain per-token construction of it."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from rtxcore.contracts.scheduler import SchedulerOutput
from rtxcore.engine.batch_builder import build_step
from tests.helpers.kv import make_manager, make_request

BLOCK_SIZE = 4


def expected_layout(reqs, counts, block_ids_of):
    """The layout spelled out one token at a time: decodes first (shortest context first), then prefill chunks."""
    order = sorted(range(len(reqs)), key=lambda i: (counts[i] != 1, reqs[i].num_tokens if counts[i] == 1 else 0))
    reqs, counts = [reqs[i] for i in order], [counts[i] for i in order]
    layout = {name: [] for name in ("input_ids", "positions", "slot_mapping", "seq_lens", "logits_indices")}
    layout["query_start_loc"] = [0]
    tables, sampling_reqs = [], []
    for req, n in zip(reqs, counts):
        start, end = req.num_computed_tokens, req.num_computed_tokens + n
        blocks = block_ids_of(req.req_id)
        layout["input_ids"] += req.all_token_ids[start:end]
        layout["positions"] += range(start, end)
        layout["slot_mapping"] += [blocks[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in range(start, end)]
        layout["query_start_loc"].append(layout["query_start_loc"][-1] + n)
        layout["seq_lens"].append(end)
        tables.append(blocks)
        if end == req.num_tokens:
            layout["logits_indices"].append(layout["query_start_loc"][-1] - 1)
            sampling_reqs.append(req)
    width = max(len(t) for t in tables)
    layout["block_tables"] = [t + [0] * (width - len(t)) for t in tables]
    return reqs, counts, sampling_reqs, layout


def scheduled(kv, specs):
    """Requests in the state the scheduler leaves them: ``(prompt_len, num_outputs, num_computed, num_new)``."""
    reqs, counts = [], []
    for i, (prompt_len, num_outputs, num_computed, num_new) in enumerate(specs):
        req = make_request(range(100 * i, 100 * i + prompt_len), max_tokens=64)
        req.all_token_ids += [7 + i] * num_outputs
        req.num_computed_tokens = num_computed
        assert kv.allocate(req, num_new)
        reqs.append(req)
        counts.append(num_new)
    return reqs, counts


@pytest.mark.parametrize("specs", [
    # A mixed step: a prefill chunk that does not reach the end, decodes of different lengths, a whole prompt, and
    # a one-token prefill chunk that is not the prompt's last token (sorted with the decodes, but does not sample).
    [(30, 0, 8, 12), (10, 3, 12, 1), (7, 0, 0, 7), (9, 0, 7, 1), (5, 1, 5, 1), (17, 6, 22, 1)],
    # Decodes only, the usual step (one of them crossing into a new block).
    [(10, 3, 12, 1), (5, 1, 5, 1), (17, 6, 22, 1), (3, 5, 7, 1), (8, 0, 7, 1)],
    # A single request, as in single-stream serving.
    [(12, 4, 15, 1)],
])
def test_build_step_lays_out_tokens_slots_and_tables(specs):
    kv = make_manager(num_blocks=64, block_size=BLOCK_SIZE)
    reqs, counts = scheduled(kv, specs)
    seeded = torch.Generator().manual_seed(1)
    plan = build_step(SchedulerOutput(reqs, counts), kv.block_table, BLOCK_SIZE, {reqs[0].req_id: seeded})

    order, order_counts, sampling_reqs, layout = expected_layout(reqs, counts, kv.block_ids)
    assert plan.reqs == order and plan.num_tokens == order_counts and plan.sampling_reqs == sampling_reqs
    batch = plan.batch
    for name in ("input_ids", "positions", "slot_mapping", "logits_indices", "block_tables"):
        tensor = getattr(batch, name)
        assert tensor.device.type == "cpu" and tensor.is_contiguous(), name
        assert tensor.tolist() == layout[name], name
    assert batch.input_ids.dtype == batch.positions.dtype == batch.slot_mapping.dtype == torch.long
    assert batch.logits_indices.dtype == torch.long and batch.block_tables.dtype == torch.int32
    assert batch.query_start_loc == layout["query_start_loc"] and batch.seq_lens == layout["seq_lens"]
    assert batch.num_decodes == counts.count(1) and batch.block_size == BLOCK_SIZE and batch.write_kv

    sampling = plan.sampling
    assert sampling.params == [r.params for r in sampling_reqs]
    assert sampling.prompt_token_ids == [r.prompt_token_ids for r in sampling_reqs]
    assert sampling.output_token_ids == [r.all_token_ids[r.num_prompt_tokens:] for r in sampling_reqs]
    assert sampling.generators == [seeded if r is reqs[0] else None for r in sampling_reqs]


def test_block_table_follows_requests_as_they_come_and_go():
    # More requests, and longer ones, than the table's initial rows and columns.
    kv = make_manager(num_blocks=600, block_size=BLOCK_SIZE)
    reqs = [make_request(range(1000 * i, 1000 * i + 3 + 5 * i)) for i in range(24)]
    for req in reqs:
        assert kv.allocate(req, req.num_tokens)
    for req in reqs[::3]:
        kv.free(req)
    for req in reqs[1::3]:  # grow into new blocks
        req.num_computed_tokens = req.num_tokens
        req.all_token_ids += [5] * 9
        assert kv.allocate(req, 9)
    newcomer = make_request(range(50_000, 50_070))
    assert kv.allocate(newcomer, newcomer.num_tokens)  # takes a freed row, whose old ids must be gone
    kv.check_invariants()

    req_ids = [r.req_id for r in [*reqs, newcomer]] + ["unknown"]
    table = kv.block_table(req_ids)
    width = max(len(kv.block_ids(req_id)) for req_id in req_ids)
    assert table.dtype == np.int32 and table.shape == (len(req_ids), width) and table.flags.c_contiguous
    assert table.tolist() == [kv.block_ids(r) + [0] * (width - len(kv.block_ids(r))) for r in req_ids]
    assert kv.block_table([]).shape == (0, 0)
