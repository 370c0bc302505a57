"""The sampler contract: greedy is argmax, draws stay inside top-k / top-p / min-p, seeds reproduce, logprobs are raw,
and draws follow the target distribution.

Each check takes a sampler instance and plain inputs, so the suite can feed it fixed cases and hypothesis examples.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rtx_conformance.checks.sampler_reference import allowed_mask, reference_probs
from rtx_conformance.checks.stats import FitResult, goodness_of_fit
from rtx_conformance.rules import require
from rtxcore.contracts.sampler import Sampler, SamplerOutput, SamplingBatch
from rtxcore.sampling_params import SamplingParams

# Per case of the distribution check: the chance that a correct sampler fails it.
DISTRIBUTION_ALPHA = 1e-4
DISTRIBUTION_DRAWS = 4000


def make_batch(params: list[SamplingParams], generators: list[torch.Generator | None] | None = None
               ) -> SamplingBatch:
    n = len(params)
    return SamplingBatch(params=list(params), prompt_token_ids=[[1, 2, 3] for _ in range(n)],
                         output_token_ids=[[] for _ in range(n)], generators=generators or [None] * n)


def sample(sampler: Sampler, logits: torch.Tensor, batch: SamplingBatch) -> SamplerOutput:
    """Call the sampler on a copy (it may modify logits in place) and check the output's shape."""
    out = sampler.sample(logits.clone(), batch)
    ids = out.token_ids
    require(isinstance(ids, torch.Tensor) and ids.dtype == torch.int64 and tuple(ids.shape) == (len(batch),),
            "sampler.output_shape", f"got {type(ids).__name__} {getattr(ids, 'dtype', '')} "
            f"{tuple(getattr(ids, 'shape', ()))}, expected int64 [{len(batch)}]")
    vocab = logits.shape[1]
    require(bool(((ids >= 0) & (ids < vocab)).all()), "sampler.output_shape",
            f"token ids {ids.tolist()[:8]} outside [0, {vocab})")
    return out


def check_greedy(sampler: Sampler, logits: torch.Tensor, greedy_rows: list[bool], other: SamplingParams) -> None:
    """Rows flagged greedy (temperature 0) must get their row's maximum, whatever the other rows ask."""
    params = [SamplingParams(temperature=0.0) if g else other for g in greedy_rows]
    ids = sample(sampler, logits, make_batch(params)).token_ids.cpu()
    for row, greedy in enumerate(greedy_rows):
        if greedy:
            chosen, best = logits[row, ids[row]].item(), logits[row].max().item()
            require(chosen == best, "sampler.greedy_argmax",
                    f"row {row}: token {ids[row].item()} has logit {chosen}, the maximum is {best} "
                    f"(token {logits[row].argmax().item()})")


def check_allowed_set(sampler: Sampler, logits: torch.Tensor, params: SamplingParams, num_draws: int) -> None:
    """Draw ``num_draws`` times from one row (as a batch of copies) and check every token is allowed."""
    batch_logits = logits.unsqueeze(0).expand(num_draws, -1).contiguous()
    ids = sample(sampler, batch_logits, make_batch([params] * num_draws)).token_ids.cpu()
    allowed = allowed_mask(logits, params)
    leaked = sorted({t for t in ids.tolist() if not allowed[t]})
    require(not leaked, "sampler.allowed_set",
            f"emitted token(s) {leaked[:8]} outside the {int(allowed.sum())} allowed for {_describe(params)}")


def check_seeded(sampler: Sampler, logits: torch.Tensor, seed: int, num_steps: int = 3) -> None:
    """A seeded row's tokens over a few steps: equal on a rerun and equal alone versus batched with other rows."""
    params = SamplingParams(temperature=1.0, seed=seed)
    unseeded = SamplingParams(temperature=1.0)
    row = logits[:1]

    def run(batched: bool) -> list[int]:
        generator = torch.Generator(device=logits.device).manual_seed(seed)
        tokens = []
        for _ in range(num_steps):
            if batched:
                other = torch.Generator(device=logits.device).manual_seed(seed + 1)
                batch = make_batch([unseeded, params, SamplingParams(temperature=0.7, seed=seed + 1)],
                                   [None, generator, other])
                ids = sample(sampler, torch.cat([logits[1:2], row, logits[:1] * 0.5]), batch).token_ids
                tokens.append(int(ids[1]))
            else:
                tokens.append(int(sample(sampler, row, make_batch([params], [generator])).token_ids[0]))
        return tokens

    alone = run(False)
    require(run(False) == alone, "sampler.seeded_reproducible",
            f"seed {seed}: tokens {alone} on one run, different on the next")
    batched = run(True)
    require(batched == alone, "sampler.seeded_reproducible",
            f"seed {seed}: tokens {alone} alone but {batched} when batched with other rows")


def check_logprobs(sampler: Sampler, logits: torch.Tensor, params: SamplingParams) -> None:
    asking = SamplingParams(temperature=params.temperature, top_k=params.top_k, top_p=params.top_p,
                            min_p=params.min_p, logprobs=2)
    out = sample(sampler, logits, make_batch([asking] * logits.shape[0]))
    require(out.logprobs is not None, "sampler.logprobs", "rows asked for logprobs=2 and got none")
    raw = torch.log_softmax(logits.double(), dim=-1).gather(1, out.token_ids.cpu().unsqueeze(1)).squeeze(1)
    error = (out.logprobs.double().cpu() - raw).abs().max().item()
    require(error <= 1e-4, "sampler.logprobs", f"chosen tokens' logprobs differ from log_softmax(raw) by {error:.3g}")


def target_distribution(sampler: Sampler, logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution the sampler declares for one row, checked to be an honest truncation; else the standard."""
    declared = sampler.target_probs(logits.unsqueeze(0).clone(), make_batch([params]))
    if declared is None:
        return reference_probs(logits, params)
    target = declared[0].double().cpu()
    require(abs(target.sum().item() - 1) <= 1e-4 and bool((target >= 0).all()), "sampler.target_is_truncation",
            f"declared distribution sums to {target.sum().item():.6f} or has negative entries")
    support = target > 0
    allowed = allowed_mask(logits, params)
    outside = (support & ~allowed).nonzero().flatten().tolist()
    require(not outside, "sampler.target_is_truncation",
            f"declared distribution gives tokens {outside[:8]} outside the allowed set for {_describe(params)}")
    best = int(logits.argmax())
    require(bool(support[best]), "sampler.target_is_truncation", f"declared distribution drops the argmax {best}")
    scaled = torch.softmax(logits.double() / max(params.temperature, 1e-6), dim=-1)
    ratio = target[support] / scaled[support]
    spread = (ratio.max() / ratio.min()).item() - 1
    require(spread <= 1e-3, "sampler.target_is_truncation",
            f"declared probabilities are not proportional to softmax(logits / T) on their support "
            f"(ratios differ by {spread:.3g})")
    return target


@dataclass(frozen=True, slots=True)
class DistributionCase:
    logits: torch.Tensor
    params: SamplingParams
    # Seed of the default generator for the draws, so a run is repeatable.
    seed: int


def check_distribution(sampler: Sampler, case: DistributionCase,
                       num_draws: int = DISTRIBUTION_DRAWS, alpha: float = DISTRIBUTION_ALPHA) -> FitResult:
    """Chi-square goodness of fit of ``num_draws`` draws against the target; a correct sampler fails with
    probability about ``alpha``."""
    target = target_distribution(sampler, case.logits, case.params)
    batch_logits = case.logits.unsqueeze(0).expand(num_draws, -1).contiguous()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(case.seed)
        ids = sample(sampler, batch_logits, make_batch([case.params] * num_draws)).token_ids.cpu()
    counts = torch.bincount(ids, minlength=case.logits.shape[0]).tolist()
    fit = goodness_of_fit(counts, target.tolist(), alpha)
    require(fit.passed, "sampler.distribution",
            f"{_describe(case.params)}: chi-square {fit.statistic:.1f} > {fit.critical:.1f} "
            f"({fit.degrees_of_freedom} dof, alpha {alpha}), {fit.impossible_draws} draws of impossible tokens")
    return fit


def _describe(params: SamplingParams) -> str:
    return (f"temperature={params.temperature} top_k={params.top_k} top_p={params.top_p} min_p={params.min_p}")

