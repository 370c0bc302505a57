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
    """Call the sampler on a copy (it may modify logits in place) and check the output's type and shape."""
    out = sampler.sample(logits.clone(), batch)
    require(isinstance(out, SamplerOutput), "sampler.api",
            f"sample() returned {type(out).__name__}, not a SamplerOutput")
    ids = out.token_ids
    require(isinstance(ids, torch.Tensor) and ids.dtype == torch.int64 and tuple(ids.shape) == (len(batch),),
            "sampler.output_shape", f"got {type(ids).__name__} {getattr(ids, 'dtype', '')} "
            f"{tuple(getattr(ids, 'shape', ()))}, expected int64 [{len(batch)}]")
    vocab = logits.shape[1]
    require(bool(((ids >= 0) & (ids < vocab)).all()), "sampler.output_shape",
            f"token ids {ids.tolist()[:8]} outside [0, {vocab})")
    return out


def check_greedy(sampler: Sampler, logits: torch.Tensor, greedy_rows: list[bool], other: SamplingParams,
                 greedy_only: bool = False) -> None:
    """Rows flagged greedy (temperature 0) must get their row's maximum, whatever the other rows ask; every row must,
    for a sampler that declares ``greedy_only``."""
    params = [SamplingParams(temperature=0.0) if g else other for g in greedy_rows]
    ids = sample(sampler, logits, make_batch(params)).token_ids.cpu()
    for row, greedy in enumerate(greedy_rows):
        if greedy or greedy_only:
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
    require(isinstance(declared, torch.Tensor) and tuple(declared.shape) == (1, logits.shape[0]), "sampler.api",
            f"target_probs() returned {type(declared).__name__} {tuple(getattr(declared, 'shape', ()))}, expected "
            f"None or a tensor [1, {logits.shape[0]}]")
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


def draw_counts(sampler: Sampler, logits: torch.Tensor, params: SamplingParams, num_draws: int,
                seed: int = 0) -> torch.Tensor:
    """How often each token is drawn from one row, ``num_draws`` times (a batch of copies, unseeded rows drawing from
    the default generator, seeded for a repeatable verdict): int64 [vocab]."""
    batch_logits = logits.unsqueeze(0).expand(num_draws, -1).contiguous()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        ids = sample(sampler, batch_logits, make_batch([params] * num_draws)).token_ids.cpu()
    return torch.bincount(ids, minlength=logits.shape[0])


def entropy(counts: torch.Tensor) -> float:
    """Entropy in nats of the empirical distribution of ``counts``."""
    probs = counts.double() / counts.sum()
    probs = probs[probs > 0]
    return float(-(probs * probs.log()).sum())


def check_temperature(sampler: Sampler, logits: torch.Tensor, low: float = 0.5, high: float = 2.0,
                      num_draws: int = 2000) -> tuple[float, float]:
    """Draws at the higher temperature must be more spread: their entropy must rise by at least half of what the
    standard distribution's does between the two temperatures (a truncating sampler keeps fewer tokens, so it rises
    by less). Returns the two empirical entropies."""
    rule = "sampler.temperature"
    cold = entropy(draw_counts(sampler, logits, SamplingParams(temperature=low), num_draws))
    hot = entropy(draw_counts(sampler, logits, SamplingParams(temperature=high), num_draws, seed=1))
    standard = (_entropy_of(reference_probs(logits, SamplingParams(temperature=high)))
                - _entropy_of(reference_probs(logits, SamplingParams(temperature=low))))
    require(hot - cold >= standard / 2, rule,
            f"entropy of the draws is {cold:.3f} nats at T={low} and {hot:.3f} at T={high}: a rise of "
            f"{hot - cold:.3f}, the standard distribution's is {standard:.3f} (at least half of it expected)")
    return cold, hot


def check_filter(sampler: Sampler, logits: torch.Tensor, params: SamplingParams, num_draws: int = 2000) -> int:
    """A filter must narrow the draws (fewer distinct tokens than the same row without it) and leave more than one
    token where its set keeps several of at least 5% probability. Returns the number of distinct tokens drawn."""
    unfiltered = SamplingParams(temperature=params.temperature)
    num_unfiltered = int((draw_counts(sampler, logits, unfiltered, num_draws) > 0).sum())
    num_filtered = int((draw_counts(sampler, logits, params, num_draws, seed=1) > 0).sum())
    require(num_filtered < num_unfiltered, "sampler.filters",
            f"{_describe(params)}: draws spread over {num_filtered} tokens, as many as without the filter "
            f"({num_unfiltered})")
    likely = int((reference_probs(logits, params) >= 0.05).sum())
    require(num_filtered >= min(2, likely), "sampler.filters",
            f"{_describe(params)}: every draw is one token, where the filter keeps {likely} tokens of at least 5% "
            f"probability")
    return num_filtered


def check_seed(sampler: Sampler, logits: torch.Tensor, num_rows: int = 16) -> int:
    """Rows alike but for their seeds (0, 1, ...) must not all draw the same token. Returns how many tokens they
    drew."""
    generators = [torch.Generator(device=logits.device).manual_seed(seed) for seed in range(num_rows)]
    params = [SamplingParams(temperature=1.0, seed=seed) for seed in range(num_rows)]
    batch_logits = logits.unsqueeze(0).expand(num_rows, -1).contiguous()
    ids = sample(sampler, batch_logits, make_batch(params, list(generators))).token_ids.cpu()
    distinct = len(set(ids.tolist()))
    require(distinct > 1, "sampler.seed",
            f"{num_rows} rows seeded 0 to {num_rows - 1} all drew token {ids[0].item()} (temperature 1, where the "
            f"likeliest token has {reference_probs(logits, params[0]).max().item():.0%})")
    return distinct


def _entropy_of(probs: torch.Tensor) -> float:
    probs = probs[probs > 0]
    return float(-(probs * probs.log()).sum())


def _describe(params: SamplingParams) -> str:
    return (f"temperature={params.temperature} top_k={params.top_k} top_p={params.top_p} min_p={params.min_p}")

