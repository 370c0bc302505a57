"""A minimal engine loop for one backend: sequences over shuffled KV blocks, prefill chunks and decodes batched
together, greedy tokens from the backend's own logits. It builds :class:`ForwardBatch` by hand from the contract's
field descriptions, so a backend is tested against the contract rather than against the engine's batch builder."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import torch

from rtx_conformance.rules import require
from rtxcore.contracts.backend import ExecutionBackend, ForwardBatch


@dataclass(slots=True)
class Sequence:
    token_ids: list[int]
    block_ids: list[int]
    num_computed: int = 0
    generated: list[int] = field(default_factory=list)
    # Logits the backend returned for this sequence, by the position of the token they follow.
    logits: dict[int, torch.Tensor] = field(default_factory=dict)


class PagedDriver:
    def __init__(self, backend: ExecutionBackend, num_blocks: int, block_size: int, seed: int = 0):
        self.backend = backend
        self.block_size = block_size
        backend.allocate_kv_cache(num_blocks, block_size)
        # Shuffled so that a backend ignoring the block table (reading blocks in order) is caught; 0 is the null block.
        self._free = list(range(1, num_blocks))
        random.Random(seed).shuffle(self._free)

    def add(self, prompt: list[int], max_len: int) -> Sequence:
        num_blocks = -(-max_len // self.block_size)
        blocks, self._free = self._free[:num_blocks], self._free[num_blocks:]
        return Sequence(list(prompt), blocks)

    def step(self, work: list[tuple[Sequence, int]]) -> None:
        """Compute ``n`` new tokens of each ``(seq, n)``; a sequence reaching its end samples its argmax."""
        work = sorted(work, key=lambda item: item[1] != 1)  # decodes first, as ForwardBatch requires
        ids, positions, slots, starts, seq_lens, logit_rows = [], [], [], [0], [], []
        for seq, n in work:
            for pos in range(seq.num_computed, seq.num_computed + n):
                ids.append(seq.token_ids[pos])
                positions.append(pos)
                slots.append(seq.block_ids[pos // self.block_size] * self.block_size + pos % self.block_size)
            starts.append(starts[-1] + n)
            seq_lens.append(seq.num_computed + n)
            if seq.num_computed + n == len(seq.token_ids):
                logit_rows.append(starts[-1] - 1)
        width = max(len(seq.block_ids) for seq, _ in work)
        tables = torch.zeros((len(work), width), dtype=torch.int32)
        for row, (seq, _) in enumerate(work):
            tables[row, :len(seq.block_ids)] = torch.tensor(seq.block_ids, dtype=torch.int32)
        batch = ForwardBatch(
            input_ids=torch.tensor(ids, dtype=torch.int64), positions=torch.tensor(positions, dtype=torch.int64),
            query_start_loc=starts, seq_lens=seq_lens, block_tables=tables,
            slot_mapping=torch.tensor(slots, dtype=torch.int64),
            logits_indices=torch.tensor(logit_rows, dtype=torch.int64), block_size=self.block_size,
            num_decodes=sum(1 for _, n in work if n == 1))
        sampling = [seq for seq, n in work if seq.num_computed + n == len(seq.token_ids)]
        logits = self._execute(batch, len(sampling))
        for seq, n in work:
            seq.num_computed += n
        for seq, row in zip(sampling, logits):
            seq.logits[len(seq.token_ids) - 1] = row
            token = int(row.argmax())
            seq.generated.append(token)
            seq.token_ids.append(token)

    def score(self, token_ids: list[int]) -> torch.Tensor:
        """Logits after each token but the last, [len - 1, vocab], from one whole-prompt prefill (perplexity)."""
        seq = self.add(token_ids, len(token_ids))
        batch = ForwardBatch.prefill(token_ids, seq.block_ids, self.block_size,
                                     torch.arange(len(token_ids) - 1, dtype=torch.int64))
        logits = self._execute(batch, len(token_ids) - 1)
        self._free += seq.block_ids
        return logits

    def _execute(self, batch: ForwardBatch, num_rows: int) -> torch.Tensor:
        """``execute(batch)`` as float32 on the host, checked to hold one row per requested position."""
        logits = self.backend.execute(batch)
        require(isinstance(logits, torch.Tensor) and logits.dim() == 2 and logits.shape[0] == num_rows,
                "backend.api", f"execute() returned {type(logits).__name__} {tuple(getattr(logits, 'shape', ()))} "
                f"for {num_rows} requested rows: a tensor [rows, vocab_size]")
        return logits.float().cpu()
