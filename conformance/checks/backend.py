"""The backend contract: on a small random-weight model, logits match Hugging Face transformers on the very same
weights within a stated tolerance, and greedy tokens equal transformers' ``generate``.

transformers is an independent implementation of the Llama architecture; comparing a backend with itself (or with
the engine that drives it) would prove nothing.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch

from rtx_conformance.checks.paged_driver import PagedDriver, Sequence
from rtx_conformance.rules import build, require
from rtxcore.contracts.backend import BackendCapabilities, BackendOptions, ExecutionBackend
from rtxcore.models.source import ModelSource

# Tolerance on float32 logits: |ours - reference| <= ATOL + RTOL * max|reference| over every compared position.
ATOL = 1e-4
RTOL = 1e-3
BLOCK_SIZE = 16


@dataclass(frozen=True, slots=True)
class BackendRun:
    max_abs_diff: float
    tolerance: float
    num_positions: int
    greedy_tokens: list[list[int]]


def check_capabilities(backend_cls: type[ExecutionBackend]) -> BackendCapabilities:
    caps = backend_cls.capabilities()
    require(isinstance(caps, BackendCapabilities), "backend.capabilities",
            f"capabilities() returned {type(caps).__name__}")
    return caps


def run_against_reference(backend_cls: type[ExecutionBackend], source: ModelSource, reference,
                          prompt_lens: tuple[int, ...] = (7, 20, 37), num_new_tokens: int = 8,
                          seed: int = 0) -> BackendRun:
    """Prefill the prompts (the longest in two chunks, the rest whole) next to decodes, then decode greedily; compare
    every logits row with ``reference`` (a transformers causal LM) and the tokens with its ``generate``."""
    backend = build("backend", backend_cls, BackendOptions(device="cpu", dtype="float32", max_batch_size=8,
                                                           max_model_len=max(prompt_lens) + num_new_tokens))
    backend.load(source)
    rng = random.Random(seed)
    vocab = source.config.vocab_size
    prompts = [[rng.randrange(3, vocab) for _ in range(n)] for n in prompt_lens]
    driver = PagedDriver(backend, num_blocks=64, block_size=BLOCK_SIZE, seed=seed)
    seqs = [driver.add(p, len(p) + num_new_tokens) for p in prompts]
    *whole, chunked = seqs
    first_chunk = len(chunked.token_ids) // 2
    driver.step([(s, len(s.token_ids)) for s in whole] + [(chunked, first_chunk)])
    driver.step([(s, 1) for s in whole] + [(chunked, len(chunked.token_ids) - first_chunk)])
    while any(len(s.generated) < num_new_tokens for s in seqs):
        driver.step([(s, 1) for s in seqs if len(s.generated) < num_new_tokens])

    worst, scale, count = 0.0, 0.0, 0
    for seq in seqs:
        ref = _reference_logits(reference, seq)
        for pos, ours in seq.logits.items():
            worst = max(worst, (ours - ref[pos]).abs().max().item())
            scale = max(scale, ref[pos].abs().max().item())
            count += 1
    tolerance = ATOL + RTOL * scale
    require(worst <= tolerance, "backend.logits_match",
            f"max |logits - reference| is {worst:.3g} over {count} positions, tolerance {tolerance:.3g} "
            f"({ATOL} + {RTOL} x max|reference| {scale:.3g})")
    for seq, prompt in zip(seqs, prompts):
        expected = _reference_greedy(reference, prompt, num_new_tokens)
        require(seq.generated == expected, "backend.greedy_tokens",
                f"prompt of {len(prompt)} tokens: greedy tokens {seq.generated}, reference {expected}")
    return BackendRun(worst, tolerance, count, [s.generated for s in seqs])


@torch.inference_mode()
def _reference_logits(reference, seq: Sequence) -> torch.Tensor:
    ids = torch.tensor([seq.token_ids[:-1]])
    return reference(input_ids=ids).logits[0].float()


@torch.inference_mode()
def _reference_greedy(reference, prompt: list[int], num_new_tokens: int) -> list[int]:
    ids = torch.tensor([prompt])
    out = reference.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=num_new_tokens,
                             do_sample=False, pad_token_id=0)
    return out[0, len(prompt):].tolist()
