"""Locally typical sampling (Meister et al., 2023) on top of temperature, top-k, top-p and min-p.

After the usual filters, a row keeps the tokens whose surprisal ``-log p`` is closest to the distribution's entropy,
fewest first, until they hold ``typical_mass`` of the probability; the most likely token always stays, so a greedy
reading of the same row never falls outside the set. ``SamplingParams`` has no typical-p field, so the mass is a
property of the sampler: subclass and register another name for another mass.
"""

from __future__ import annotations

import torch

from rtxcore.contracts import Sampler, SamplerOutput, SamplingBatch
from rtxcore.hookspecs import hookimpl


class TypicalSampler(Sampler):
    typical_mass = 0.9

    @classmethod
    def describe(cls) -> dict[str, object]:
        return {"parameters": ["temperature", "top_k", "top_p", "min_p", "seed", "logprobs"],
                "typical_mass": cls.typical_mass, "logprobs": "raw"}

    def target_probs(self, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        probs = torch.softmax(logits.float() / self._temperatures(batch, logits.device).unsqueeze(1), dim=-1)
        keep = self._filter(probs, batch) & self._typical(probs)
        kept = probs * keep
        return kept / kept.sum(dim=-1, keepdim=True)

    def sample(self, logits: torch.Tensor, batch: SamplingBatch) -> SamplerOutput:
        raw = logits.float()
        token_ids = raw.argmax(dim=-1)
        sampled = [i for i, p in enumerate(batch.params) if not p.greedy]
        if sampled:
            target = self.target_probs(raw, batch)
            draws = self._draw(target, batch, sampled)
            token_ids[sampled] = draws
        return _with_logprobs(token_ids, raw, batch)

    def _temperatures(self, batch: SamplingBatch, device: torch.device) -> torch.Tensor:
        return torch.tensor([p.temperature if p.temperature > 0 else 1.0 for p in batch.params], device=device)

    def _filter(self, probs: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        """Top-k, then top-p over what top-k left, then min-p: a keep mask."""
        keep = torch.ones_like(probs, dtype=torch.bool)
        ordered, order = probs.sort(dim=-1, descending=True)
        for row, p in enumerate(batch.params):
            row_keep = torch.ones_like(ordered[row], dtype=torch.bool)
            if 0 < p.top_k < probs.shape[1]:
                row_keep &= ordered[row] >= ordered[row, p.top_k - 1]
            if p.top_p < 1:
                mass = ordered[row] * row_keep
                ahead = (mass.cumsum(0) - mass) / mass.sum()
                row_keep &= ahead < p.top_p
            if p.min_p > 0:
                row_keep &= ordered[row] >= p.min_p * ordered[row, 0]
            keep[row, order[row]] = row_keep
        return keep

    def _typical(self, probs: torch.Tensor) -> torch.Tensor:
        logp = probs.clamp_min(1e-30).log()
        entropy = -(probs * logp).sum(dim=-1, keepdim=True)
        distance = (-logp - entropy).abs()
        order = distance.argsort(dim=-1)
        mass = probs.gather(1, order)
        inside = (mass.cumsum(dim=-1) - mass) < self.typical_mass
        keep = torch.zeros_like(inside).scatter(1, order, inside)
        keep[torch.arange(probs.shape[0]), probs.argmax(dim=-1)] = True
        return keep

    def _draw(self, target: torch.Tensor, batch: SamplingBatch, rows: list[int]) -> torch.Tensor:
        unseeded = [r for r in rows if batch.generators[r] is None]
        out = torch.empty(len(rows), dtype=torch.int64, device=target.device)
        position = {r: i for i, r in enumerate(rows)}
        if unseeded:
            out[[position[r] for r in unseeded]] = torch.multinomial(target[unseeded], 1).squeeze(1)
        for r in rows:
            generator = batch.generators[r]
            if generator is not None:
                out[position[r]] = torch.multinomial(target[r], 1, generator=generator)[0]
        return out


def _with_logprobs(token_ids: torch.Tensor, raw: torch.Tensor, batch: SamplingBatch) -> SamplerOutput:
    asked = [p.logprobs for p in batch.params if p.logprobs is not None]
    if not asked:
        return SamplerOutput(token_ids=token_ids)
    logprobs = torch.log_softmax(raw, dim=-1)
    top_logprobs, top_ids = logprobs.topk(min(max(asked), logprobs.shape[1]), dim=-1)
    chosen = logprobs.gather(1, token_ids.unsqueeze(1)).squeeze(1)
    return SamplerOutput(token_ids=token_ids, logprobs=chosen, top_token_ids=top_ids, top_logprobs=top_logprobs)


@hookimpl
def register_samplers(register) -> None:
    register("typical", TypicalSampler)
