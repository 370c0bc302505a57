"""Independent reference for what a sampler may draw: one row at a time, in float64, in the plainest form.

Order (as Hugging Face applies them): temperature, top-k, top-p over what top-k left (renormalized), min-p relative
to the most likely token that is left. ``allowed_mask`` is lenient at the edges (ties and a relative slack of
``SLACK``) so float32 rounding in a sampler never counts as a leak; ``reference_probs`` is exact.
"""

from __future__ import annotations

import torch

from rtxcore.sampling_params import SamplingParams

SLACK = 1e-5


def reference_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The standard target distribution of one row: [vocab] float64, summing to 1."""
    keep = _keep(logits, params, slack=0.0)
    probs = torch.softmax(_scaled(logits, params), dim=-1) * keep
    return probs / probs.sum()


def allowed_mask(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Tokens a sampler may emit for one row: [vocab] bool."""
    return _keep(logits, params, slack=SLACK)


def _scaled(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    logits = logits.double()
    return logits / params.temperature if params.temperature > 0 else logits


def _keep(logits: torch.Tensor, params: SamplingParams, slack: float) -> torch.Tensor:
    scaled = _scaled(logits, params)
    vocab = scaled.shape[-1]
    keep = torch.ones(vocab, dtype=torch.bool)
    if 0 < params.top_k < vocab:
        kth = scaled.sort(descending=True).values[params.top_k - 1]
        keep &= scaled >= kth - slack * kth.abs()
    if params.top_p < 1:
        probs = torch.softmax(scaled.masked_fill(~keep, float("-inf")), dim=-1)
        ordered = probs.sort(descending=True).values
        mass_ahead = ordered.cumsum(0) - ordered
        # The smallest probability still inside the nucleus; every token at least as likely stays (ties).
        last = ordered[mass_ahead < params.top_p + slack][-1]
        keep &= probs >= last * (1 - slack)
    if params.min_p > 0:
        probs = torch.softmax(scaled.masked_fill(~keep, float("-inf")), dim=-1)
        keep &= probs >= params.min_p * probs.max() * (1 - slack)
    return keep
