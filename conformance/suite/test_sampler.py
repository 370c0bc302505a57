"""Sampler contract: greedy is argmax, draws stay in the allowed set, seeds reproduce, logprobs are raw, the
empirical distribution matches the target, and temperature, the filters and the seed each change the draws.

A sampler that declares ``greedy_only`` is held to the argmax on every row instead: the checks of how it draws are
skipped, with that reason.

The distribution test's stated false-failure rate: each of its cases fails a correct sampler with probability
about ``DISTRIBUTION_ALPHA`` (1e-4), so the whole test with its four cases about 4e-4; the draws are seeded, so a
given sampler gets the same verdict on every run.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from rtx_conformance.checks.sampler import (
    DistributionCase,
    check_allowed_set,
    check_distribution,
    check_filter,
    check_greedy,
    check_logprobs,
    check_seed,
    check_seeded,
    check_temperature,
)
from rtx_conformance.rules import build
from rtx_conformance.suite.budgets import QUICK
from rtxcore.sampling_params import SamplingParams

pytestmark = [pytest.mark.rtx_kind("sampler"), pytest.mark.rtx_rules("sampler.builds")]


def new_sampler(component):
    return build("sampler", component.cls)


@pytest.fixture
def drawing(component) -> None:
    """For the checks of how a sampler draws: skipped for one that declares it only ever takes the argmax."""
    if component.cls.greedy_only:
        pytest.skip("the sampler declares greedy_only: it draws nothing (sampler.greedy_argmax holds it to the "
                    "argmax of every row)")


def _logits(rows: int, vocab: int, seed: int, scale: float = 2.0) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * scale


# Evenly spaced logits: the token just outside each filter still has a large share, so a leak shows at once.
_RAMP = torch.linspace(0.0, 3.0, 16).flip(0)
LEAK_CASES = {
    "top_k=3": SamplingParams(top_k=3),
    "top_p=0.5": SamplingParams(top_p=0.5),
    "min_p=0.3": SamplingParams(min_p=0.3),
    "top_k=5,top_p=0.7,T=1.5": SamplingParams(top_k=5, top_p=0.7, temperature=1.5),
}


@pytest.mark.rtx_rules("sampler.greedy_argmax", "sampler.output_shape")
@QUICK
@given(rows=st.integers(1, 6), vocab=st.integers(2, 300), seed=st.integers(0, 2**16),
       greedy_rows=st.lists(st.booleans(), min_size=6, max_size=6), top_k=st.integers(0, 20))
def test_greedy_is_argmax(component, rows, vocab, seed, greedy_rows, top_k):
    check_greedy(new_sampler(component), _logits(rows, vocab, seed), greedy_rows[:rows],
                 SamplingParams(temperature=0.9, top_k=top_k), greedy_only=component.cls.greedy_only)


@pytest.mark.parametrize("params", list(LEAK_CASES.values()), ids=list(LEAK_CASES))
@pytest.mark.rtx_rules("sampler.allowed_set", "sampler.output_shape")
def test_allowed_set(component, params):
    check_allowed_set(new_sampler(component), _RAMP, params, num_draws=2000)


@pytest.mark.rtx_rules("sampler.allowed_set", "sampler.output_shape")
@QUICK
@given(vocab=st.integers(2, 200), seed=st.integers(0, 2**16), temperature=st.floats(0.3, 2.0),
       top_k=st.integers(0, 30), top_p=st.floats(0.05, 1.0), min_p=st.floats(0.0, 0.5))
def test_allowed_set_property(component, vocab, seed, temperature, top_k, top_p, min_p):
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
    check_allowed_set(new_sampler(component), _logits(1, vocab, seed)[0], params, num_draws=256)


@pytest.mark.parametrize("seed", [0, 12345])
@pytest.mark.rtx_rules("sampler.seeded_reproducible", "sampler.output_shape")
def test_seeded_reproducible(component, seed):
    check_seeded(new_sampler(component), _logits(2, 64, seed, scale=0.5), seed)


@pytest.mark.rtx_rules("sampler.logprobs", "sampler.output_shape")
def test_logprobs(component):
    check_logprobs(new_sampler(component), _logits(4, 50, 7), SamplingParams(temperature=0.8, top_k=10))


@pytest.mark.rtx_rules("sampler.temperature", "sampler.output_shape")
def test_temperature(component, drawing, record_figures):
    cold, hot = check_temperature(new_sampler(component), _RAMP)
    record_figures({"entropy_t0.5": round(cold, 3), "entropy_t2": round(hot, 3)})


@pytest.mark.parametrize("params", list(LEAK_CASES.values())[:3], ids=list(LEAK_CASES)[:3])
@pytest.mark.rtx_rules("sampler.filters", "sampler.output_shape")
def test_filters(component, drawing, params):
    check_filter(new_sampler(component), _RAMP, params)


@pytest.mark.rtx_rules("sampler.seed", "sampler.output_shape")
def test_seed(component, drawing):
    check_seed(new_sampler(component), _RAMP)


DISTRIBUTION_CASES = {
    "plain": DistributionCase(torch.linspace(-1.0, 1.5, 8), SamplingParams(), seed=1),
    "T=0.7,top_k=10": DistributionCase(_logits(1, 32, 1)[0] / 2, SamplingParams(temperature=0.7, top_k=10), seed=2),
    "top_p=0.8": DistributionCase(_logits(1, 32, 2)[0] / 2, SamplingParams(top_p=0.8), seed=3),
    "T=1.3,min_p=0.1": DistributionCase(_logits(1, 32, 3)[0] / 2, SamplingParams(temperature=1.3, min_p=0.1),
                                        seed=4),
}


@pytest.mark.parametrize("case", list(DISTRIBUTION_CASES.values()), ids=list(DISTRIBUTION_CASES))
@pytest.mark.rtx_rules("sampler.distribution", "sampler.target_is_truncation", "sampler.output_shape")
def test_distribution(component, drawing, case, record_figures):
    fit = check_distribution(new_sampler(component), case)
    record_figures({"chi_square": round(fit.statistic, 2), "critical": round(fit.critical, 2)})
