"""Perplexity of a backend on text, from whole-sequence prefills: the quality figure of quantization."""

from __future__ import annotations

import math

import torch

from rtxcore.contracts.backend import ExecutionBackend, ForwardBatch
from rtxcore.errors import ConfigError

# How much an fp8 KV cache (--kv-cache-dtype fp8) may raise perplexity, as a ratio to the model's own cache: the
# budget docs/quantization.md states, held by tests/engine/test_fp8_kv_cache.py and benchmarks/fp8_quality.py.
FP8_KV_CACHE_MAX_PPL_RATIO = 1.03


def perplexity(logits: torch.Tensor, token_ids: list[int]) -> float:
    """exp of the mean negative log-likelihood of tokens 1.. given ``logits`` [len - 1, vocab] after each."""
    targets = torch.tensor(token_ids[1:])
    nll = torch.nn.functional.cross_entropy(logits.double(), targets, reduction="mean")
    return math.exp(nll.item())


def prefill_logits(backend: ExecutionBackend, token_ids: list[int], block_size: int = 16,
                   all_positions: bool = True) -> torch.Tensor:
    """Logits after each token but the last (or only after the last one), from one prefill into blocks 1.. of a cache
    the caller allocated."""
    blocks = list(range(1, 1 + -(-len(token_ids) // block_size)))
    n = len(token_ids)
    rows = torch.arange(n - 1, dtype=torch.int64) if all_positions else torch.tensor([n - 1], dtype=torch.int64)
    return backend.execute(ForwardBatch.prefill(token_ids, blocks, block_size, rows)).float().cpu()


def _nll_sum(backend: ExecutionBackend, piece: list[int], block_size: int) -> float:
    """The summed negative log-likelihood of tokens 1.. of ``piece``, from one prefill."""
    logits = prefill_logits(backend, piece, block_size)
    return torch.nn.functional.cross_entropy(logits.double(), torch.tensor(piece[1:]), reduction="sum").item()


def piece_nlls(backend: ExecutionBackend, pieces: list[list[int]], block_size: int = 16) -> list[float]:
    """The mean negative log-likelihood of tokens 1.. of each piece, each scored from its own prefill."""
    return [_nll_sum(backend, piece, block_size) / (len(piece) - 1) for piece in pieces]


def backend_perplexity(backend: ExecutionBackend, token_ids: list[int], chunk_len: int, block_size: int = 16) -> float:
    """Perplexity over ``token_ids`` scored in independent pieces of ``chunk_len`` (what the cache has room for)."""
    nll, count = 0.0, 0
    for start in range(0, len(token_ids) - 1, chunk_len):
        chunk = token_ids[start:start + chunk_len]
        if len(chunk) < 2:
            break
        nll += _nll_sum(backend, chunk, block_size)
        count += len(chunk) - 1
    if count == 0:
        raise ConfigError("perplexity needs at least two tokens of text")
    return math.exp(nll / count)
