"""Pipeline parallelism: one step runs through the stages as micro-batches, each stage a contiguous run of layers.

What is shipped between ranks (the activation-shipping policy):

- Every rank gets the whole batch from rank 0 (``messages``), so each stage cuts the same micro-batches and builds
  its own attention metadata; only activations travel between stages.
- Stage s sends micro-batch i's hidden state and residual, stacked ``[2, tokens, hidden]`` in the model's dtype, to
  the rank of the same tensor-parallel index in stage s + 1 (point to point: ``isend``, so stage s starts micro-batch
  i + 1 while i is on the wire), as soon as its layers are done with it.
- The last stage applies the final norm and sends back only the rows whose logits are wanted (``[rows, hidden]``) to
  the first stage, which holds the LM head beside the embedding: hidden states are ``vocab / hidden`` times smaller
  than logits (24x for Llama 3), and rank 0 samples.

Micro-batches are cut along requests, in order, of balanced token counts; rank 0 chooses how many (at most one per
stage, each of at least ``RTX_PP_MICRO_BATCH_TOKENS``) and sends the number with the batch.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from rtx_plugins.backends.torch_backend.layers import ParallelContext
from rtxcore import envs
from rtxcore.contracts.backend import ForwardBatch

# (hidden states of a micro-batch's logit rows) -> logits: the first stage's LM head.
LogitsFn = Callable[[torch.Tensor], torch.Tensor]
# (micro-batch, stage inputs) -> this stage's outputs for it (ModelRunner-like: metadata, attention, layers).
StageFn = Callable[[ForwardBatch, torch.Tensor], torch.Tensor]


@dataclass(frozen=True, slots=True)
class MicroBatch:
    batch: ForwardBatch
    # Which rows of the step's logits (positions in the step's logits_indices) come from this micro-batch.
    logit_rows: list[int]


def count_micro_batches(batch: ForwardBatch, pp_size: int, min_tokens: int) -> int:
    """How many micro-batches rank 0 cuts a step into: one per stage at most, each of at least ``min_tokens``."""
    return max(1, min(pp_size, batch.num_reqs, batch.num_tokens // min_tokens))


def split(batch: ForwardBatch, count: int) -> list[MicroBatch]:
    """``batch`` as ``count`` micro-batches of whole requests, in order, with about equal token counts.

    Every rank calls this on the same batch and count, so every stage cuts the same micro-batches.
    """
    qsl = batch.query_start_loc
    logits_at = batch.logits_indices.tolist()
    # Request boundaries: the first request whose tokens reach past k/count of the step starts part k.
    cuts = [0]
    for k in range(1, count):
        target = batch.num_tokens * k // count
        # At least one request in the part before, and one left for each part still to come.
        r, last = cuts[-1] + 1, batch.num_reqs - (count - k)
        while r < last and qsl[r] < target:
            r += 1
        cuts.append(r)
    cuts.append(batch.num_reqs)
    parts = []
    for r0, r1 in zip(cuts, cuts[1:]):
        t0, t1 = qsl[r0], qsl[r1]
        rows = [j for j, t in enumerate(logits_at) if t0 <= t < t1]
        local = torch.tensor([logits_at[j] - t0 for j in rows], dtype=torch.int64)
        part = ForwardBatch(input_ids=batch.input_ids[t0:t1], positions=batch.positions[t0:t1],
                            query_start_loc=[q - t0 for q in qsl[r0:r1 + 1]], seq_lens=batch.seq_lens[r0:r1],
                            block_tables=batch.block_tables[r0:r1], slot_mapping=batch.slot_mapping[t0:t1],
                            logits_indices=local, block_size=batch.block_size,
                            num_decodes=max(0, min(batch.num_decodes, r1) - r0), write_kv=batch.write_kv)
        parts.append(MicroBatch(part, rows))
    return parts


class PipelineStage:
    """One rank's part of the pipeline: runs its stage over each micro-batch and moves activations along."""

    def __init__(self, ctx: ParallelContext, hidden_size: int, vocab_size: int, dtype: torch.dtype,
                 device: torch.device):
        self.ctx = ctx
        self._hidden_size = hidden_size
        self._vocab_size = vocab_size
        self._dtype = dtype
        self._device = device
        # Global ranks are stage-major (rank = stage * tp_size + tp_rank): a rank's peers keep its tp_rank.
        self._prev = self._rank_of(ctx.pp_rank - 1)
        self._next = self._rank_of(ctx.pp_rank + 1)
        self._first = self._rank_of(0)
        self._last = self._rank_of(ctx.pp_size - 1)
        # Read once: the step path does not parse the environment.
        self._min_tokens = envs.RTX_PP_MICRO_BATCH_TOKENS.get()

    def num_micro_batches(self, batch: ForwardBatch) -> int:
        """Rank 0's choice for ``batch`` (sent to the other ranks with it)."""
        return count_micro_batches(batch, self.ctx.pp_size, self._min_tokens)

    def _rank_of(self, stage: int) -> int:
        return stage * self.ctx.tp_size + self.ctx.tp_rank

    def execute(self, batch: ForwardBatch, count: int, run_stage: StageFn, logits: LogitsFn) -> torch.Tensor | None:
        """Run this stage over ``batch`` cut into ``count`` micro-batches.

        :returns: on the first stage, the step's logits (rows in ``batch.logits_indices`` order); None elsewhere.
        """
        parts = split(batch, count)
        # The tensors in flight stay referenced until their sends complete.
        sends: list[tuple[dist.Work, torch.Tensor]] = []
        for tag, part in enumerate(parts):
            n = part.batch.num_tokens
            if self.ctx.first_stage:
                inputs = part.batch.input_ids.to(self._device)
            else:
                inputs = self._receive((2, n, self._hidden_size), self._prev, tag)
            out = run_stage(part.batch, inputs)
            if not self.ctx.last_stage:
                sends.append(self._send(out, self._next, tag))
            elif part.logit_rows:  # a prompt chunk that samples nothing sends nothing back
                sends.append(self._send(out[part.batch.logits_indices.to(self._device)], self._first, tag))
        result = None
        if self.ctx.first_stage:
            rows = sum(len(p.logit_rows) for p in parts)
            result = torch.empty((rows, self._vocab_size), dtype=torch.float32, device=self._device)
            for tag, part in enumerate(parts):
                if part.logit_rows:
                    hidden = self._receive((len(part.logit_rows), self._hidden_size), self._last, tag)
                    where = torch.tensor(part.logit_rows, dtype=torch.int64, device=self._device)
                    result[where] = logits(hidden)
        for work, _ in sends:
            work.wait()
        return result

    def _send(self, t: torch.Tensor, dst: int, tag: int) -> tuple[dist.Work, torch.Tensor]:
        t = t.contiguous()
        return dist.isend(t, dst, tag=tag), t

    def _receive(self, shape: tuple[int, ...], src: int, tag: int) -> torch.Tensor:
        buf = torch.empty(shape, dtype=self._dtype, device=self._device)
        dist.recv(buf, src, tag=tag)
        return buf
