"""What rank 0 tells the other ranks each step: a fixed-size header, then (for a step) the batch in one tensor.

Two broadcasts of plain int64 tensors per step to every rank of every stage, whatever the batch: the header says
what follows and how long each part is, so the receivers allocate the body before it arrives.
``broadcast_object_list`` would also take two broadcasts (sizes, then bytes) and pickle the tensors on top, and it
cannot carry device tensors over NCCL without a round trip through the host.
"""

from __future__ import annotations

from enum import IntEnum

import torch
import torch.distributed as dist

from rtxcore.contracts.backend import ForwardBatch

_HEADER_LEN = 10


class Command(IntEnum):
    EXECUTE = 0
    ALLOCATE_KV = 1
    SHUTDOWN = 2


def send_command(command: Command, *args: int, device: torch.device) -> None:
    dist.broadcast(_header(command, *args, device=device), src=0)


def send_batch(batch: ForwardBatch, num_micro_batches: int, device: torch.device) -> None:
    """Rank 0's half of :func:`receive_batch`: the batch's tensors and host lists, packed into one int64 tensor,
    and how many micro-batches the pipeline stages cut it into."""
    num_reqs, max_blocks = batch.block_tables.shape
    header = _header(Command.EXECUTE, batch.num_tokens, num_reqs, max_blocks, batch.logits_indices.numel(),
                     batch.block_size, batch.num_decodes, int(batch.write_kv), num_micro_batches, device=device)
    lists = torch.tensor(batch.query_start_loc + batch.seq_lens, dtype=torch.int64)
    # The input ids may already be on the device (the overlapped step fills pending rows there).
    parts = (batch.input_ids, batch.positions, batch.slot_mapping, batch.logits_indices, lists,
             batch.block_tables.flatten())
    body = torch.cat([t.to(device=device, dtype=torch.int64, non_blocking=True) for t in parts])
    dist.broadcast(header, src=0)
    dist.broadcast(body, src=0)


def receive_header(device: torch.device) -> list[int]:
    """The next command and its arguments, as ints: ``[command, *args]``."""
    header = torch.empty(_HEADER_LEN, dtype=torch.int64, device=device)
    dist.broadcast(header, src=0)
    return header.tolist()


def receive_batch(header: list[int], device: torch.device) -> tuple[ForwardBatch, int]:
    """The batch announced by an EXECUTE ``header``, rebuilt as rank 0 had it (tensors on ``device``), and its
    number of micro-batches."""
    _, num_tokens, num_reqs, max_blocks, num_logits, block_size, num_decodes, write_kv, num_micro = header[:9]
    sizes = [num_tokens, num_tokens, num_tokens, num_logits, 2 * num_reqs + 1, num_reqs * max_blocks]
    body = torch.empty(sum(sizes), dtype=torch.int64, device=device)
    dist.broadcast(body, src=0)
    input_ids, positions, slot_mapping, logits_indices, lists, block_tables = body.split(sizes)
    lists_host = lists.tolist()
    batch = ForwardBatch(input_ids=input_ids, positions=positions, query_start_loc=lists_host[:num_reqs + 1],
                         seq_lens=lists_host[num_reqs + 1:], block_tables=block_tables.view(num_reqs, max_blocks)
                         .to(torch.int32), slot_mapping=slot_mapping, logits_indices=logits_indices,
                         block_size=block_size, num_decodes=num_decodes, write_kv=bool(write_kv))
    return batch, num_micro


def _header(command: Command, *args: int, device: torch.device) -> torch.Tensor:
    values = [int(command), *args]
    return torch.tensor(values + [0] * (_HEADER_LEN - len(values)), dtype=torch.int64, device=device)
