"""Log-probabilities of a prompt's own tokens (OpenAI completions' ``echo`` with ``logprobs``), from one pass of the
model over the whole prompt that neither reads nor writes the KV cache."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from rtxcore.contracts.backend import ExecutionBackend
from rtxcore.engine.batch_builder import build_embedding_batch
from rtxcore.engine.output_processor import reportable_logprobs
from rtxcore.engine.outputs import TokenLogprob

# Tokens scored per backend call: the logits of a call are [tokens, vocab] float32 (49,152 x 512 x 4 bytes = 100 MB
# for the default model), so a long prompt goes in pieces rather than all at once.
SCORE_TOKENS_PER_CALL = 512


@torch.inference_mode()
def prompt_logprobs(backend: ExecutionBackend, token_lists: Sequence[list[int]], num_top: int,
                    block_size: int) -> list[list[TokenLogprob | None]]:
    """For each prompt, one entry per token: None for the first (nothing predicts it), else the token's log-probability
    given the tokens before it, with the ``num_top`` most likely alternatives.

    A prompt is scored whole (attention needs all of it), so one longer than :data:`SCORE_TOKENS_PER_CALL` is a call
    of its own; shorter ones share calls."""
    scored: list[list[TokenLogprob | None]] = []
    for group in scoring_groups(token_lists):
        logits = backend.score(build_embedding_batch(group, block_size))
        start = 0
        for ids in group:
            scored.append([None, *_logprobs_of(logits[start:start + len(ids) - 1], ids[1:], num_top)])
            start += len(ids)
    return scored


def _logprobs_of(logits: torch.Tensor, next_ids: list[int], num_top: int) -> list[TokenLogprob]:
    logprobs = torch.log_softmax(logits, dim=-1)
    chosen = logprobs.gather(1, torch.tensor(next_ids, dtype=torch.long, device=logprobs.device)[:, None])[:, 0]
    if num_top > 0:
        top_lp, top_ids = logprobs.topk(num_top, dim=-1)
        tops = [list(zip(ids, lps)) for ids, lps in zip(top_ids.tolist(), reportable_logprobs(top_lp))]
    else:
        tops = [[] for _ in next_ids]
    return [TokenLogprob(token_id, lp, top) for token_id, lp, top in zip(next_ids, reportable_logprobs(chosen), tops)]


def scoring_groups(token_lists: Sequence[list[int]]) -> list[list[list[int]]]:
    """``token_lists`` in order, in the groups one backend call scores."""
    groups: list[list[list[int]]] = []
    size = SCORE_TOKENS_PER_CALL
    for ids in token_lists:
        if size + len(ids) > SCORE_TOKENS_PER_CALL:
            groups.append([])
            size = 0
        groups[-1].append(ids)
        size += len(ids)
    return groups
