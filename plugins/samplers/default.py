"""The default sampler: every :class:`SamplingParams` option, batched over rows with mixed settings.

Per row, in order: repetition penalty, presence / frequency penalties, temperature (0 means greedy: argmax of the
penalized logits), top-k, top-p, min-p, then a draw. The draw is an exponential race, ``argmax(probs / q)`` with
``q ~ Exp(1)``, which samples from ``probs`` (normalized or not) without ``torch.multinomial``'s host-device sync.
"""

from __future__ import annotations

from typing import Any

import torch

from rtx_plugins.samplers.filters import apply_min_p, apply_top_k_top_p
from rtx_plugins.samplers.penalties import apply_penalties
from rtxcore.contracts import Sampler, SamplerOutput, SamplingBatch
from rtxcore.hookspecs import Register, hookimpl
from rtxcore.transfer import to_device

SUPPORTED_PARAMETERS = (
    "temperature", "top_k", "top_p", "min_p",
    "repetition_penalty", "presence_penalty", "frequency_penalty",
    "seed", "logprobs",
)


class DefaultSampler(Sampler):
    """Stateless: everything a call needs comes in with its :class:`SamplingBatch`."""

    @classmethod
    def describe(cls) -> dict[str, Any]:
        return {
            "parameters": list(SUPPORTED_PARAMETERS),
            # Logprobs describe the model's own distribution, before penalties, temperature and filters.
            "logprobs": "raw",
            "max_logprobs": 20,
            "draw": "exponential race (no host-device sync)",
        }

    def sample(self, logits: torch.Tensor, batch: SamplingBatch) -> SamplerOutput:
        if logits.dim() != 2 or logits.shape[0] != len(batch):
            raise ValueError(f"expected logits of shape [{len(batch)}, vocab_size], got {tuple(logits.shape)}")
        # One pass over the rows' options, which runs every step for every row.
        want_logprobs = penalized = False
        all_greedy = True
        for p in batch.params:
            want_logprobs = want_logprobs or p.logprobs is not None
            penalized = penalized or p.needs_output_history
            all_greedy = all_greedy and p.greedy
        raw_logprobs = None
        if want_logprobs:
            # Taken first: the steps below modify the logits in place.
            raw_logprobs = torch.log_softmax(logits, dim=-1, dtype=torch.float32)

        # float() makes no copy when already float32; reduced precision would skew penalties and filters.
        if penalized:
            logits = apply_penalties(logits.float(), batch)
        if all_greedy:
            # Widening changes no value's order, so the argmax needs no float32 copy of a large vocabulary.
            token_ids = argmax_rows(logits)
        else:
            token_ids = _sample_rows(logits.float(), batch)
        return _output(token_ids, raw_logprobs, batch)


def _sample_rows(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Tokens for a batch with at least one sampled row; greedy rows get the argmax of ``logits``."""
    params = batch.params
    vocab_size = logits.shape[1]
    greedy = [p.greedy for p in params]
    # One host-to-device copy for every per-row setting. Greedy rows get temperature 1 so nothing divides by zero;
    # their drawn token is discarded anyway. top_k is exact in float32 up to 2**24, far above any vocabulary.
    table = to_device(
        [
            [
                1.0 if p.greedy else p.temperature,
                p.top_k if 0 < p.top_k < vocab_size else vocab_size,
                p.top_p,
                p.min_p,
                float(p.greedy),
            ]
            for p in params
        ],
        torch.float32,
        logits.device,
    )
    temperature, top_k, top_p, min_p, is_greedy = table.unbind(dim=1)

    greedy_ids = argmax_rows(logits) if any(greedy) else None
    if any(not g and p.temperature != 1 for g, p in zip(greedy, params)):
        logits = logits.div_(temperature.unsqueeze(1))
    max_top_k = max((p.top_k for p in params if 0 < p.top_k < vocab_size), default=0)
    use_top_p = any(p.top_p < 1 for p in params)
    if max_top_k or use_top_p:
        logits = apply_top_k_top_p(
            logits, top_k.long() if max_top_k else None, top_p if use_top_p else None, max_top_k
        )
    probs = logits.softmax(dim=-1)
    if any(p.min_p > 0 for p in params):
        probs = apply_min_p(probs, min_p)

    sampled_ids = probs.div_(_exponentials(probs, batch)).argmax(dim=-1)
    if greedy_ids is None:
        return sampled_ids
    return torch.where(is_greedy.bool(), greedy_ids, sampled_ids)


def argmax_rows(logits: torch.Tensor, two_stage: bool | None = None) -> torch.Tensor:
    """``logits.argmax(dim=-1)``, the first index of each row's maximum, computed in two stages (by default for a
    few wide rows on an accelerator): there one row is reduced by one thread block (about 27 µs for 128k columns on
    an H200), while a maximum per chunk first spreads the row over the whole chip."""
    rows, cols = logits.shape
    if two_stage is None:
        two_stage = logits.device.type != "cpu" and rows < 32 and cols >= 16384
    if not two_stage:
        return logits.argmax(dim=-1)
    chunk = -(-cols // 128)
    if chunk * 128 != cols:
        logits = torch.nn.functional.pad(logits, (0, chunk * 128 - cols), value=float("-inf"))
    # max() and argmax() both return the first index among equal values, so ties resolve as in one argmax.
    chunk_max, chunk_arg = logits.view(rows, 128, chunk).max(dim=-1)
    best = chunk_max.argmax(dim=-1, keepdim=True)
    return (best * chunk + chunk_arg.gather(1, best)).squeeze(1)


def _exponentials(probs: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """``Exp(1)`` noise shaped like ``probs``: seeded rows from their own generator, others from the default one.

    A seeded row always draws exactly ``vocab_size`` values from its generator, whatever else is in the batch, so its
    generator's state (and its next tokens) depend only on its own history. Greedy rows draw nothing from theirs.
    """
    sampled = [not p.greedy for p in batch.params]
    if any(s and g is None for g, s in zip(batch.generators, sampled)):
        q = torch.empty_like(probs).exponential_()
    else:
        q = torch.ones_like(probs)  # only seeded and greedy rows: the default generator must not advance
    for i, (generator, is_sampled) in enumerate(zip(batch.generators, sampled)):
        if generator is None or not is_sampled:
            continue
        if _same_device(generator.device, q.device):
            q[i].exponential_(generator=generator)
        else:
            # A generator on another device (a CPU one for a GPU batch) still gives its own stream, at the cost
            # of a copy; pinned, so the host need not wait for the device.
            pin = generator.device.type == "cpu" and q.device.type != "cpu"
            noise = torch.empty(q.shape[1], device=generator.device, pin_memory=pin)
            q[i].copy_(noise.exponential_(generator=generator), non_blocking=True)
    # A draw of exactly 0 is not ruled out on every backend; 0 / 0 would be NaN, which argmax picks over any token.
    return q.clamp_min_(torch.finfo(q.dtype).tiny)


def _same_device(a: torch.device, b: torch.device) -> bool:
    # A CUDA generator reports its device without an index ("cuda"), while tensors report "cuda:0".
    return a.type == b.type and (a.index is None or b.index is None or a.index == b.index)


def _output(token_ids: torch.Tensor, raw_logprobs: torch.Tensor | None, batch: SamplingBatch) -> SamplerOutput:
    if raw_logprobs is None:
        return SamplerOutput(token_ids=token_ids)
    # Every row gets the widest request's columns; the engine trims each to what it asked for.
    num_top = min(max(p.logprobs for p in batch.params if p.logprobs is not None), raw_logprobs.shape[1])
    top_logprobs, top_token_ids = raw_logprobs.topk(num_top, dim=-1)
    chosen = raw_logprobs.gather(1, token_ids.unsqueeze(1)).squeeze(1)
    return SamplerOutput(
        token_ids=token_ids, logprobs=chosen, top_token_ids=top_token_ids, top_logprobs=top_logprobs
    )


@hookimpl
def register_samplers(register: Register) -> None:
    register("default", DefaultSampler)
