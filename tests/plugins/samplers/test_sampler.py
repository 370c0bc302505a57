"""The default sampler, loaded through the real registry and checked against direct reference computations."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rtx_plugins.samplers.penalties import apply_penalties
from rtxcore.contracts import Sampler, SamplingBatch
from rtxcore.registry import load_plugins
from rtxcore.sampling_params import SamplingParams

# Chi-square tests fail when the p-value falls below this: with a random seed a correct sampler would fail one of
# them about once in a million runs; with the fixed seeds used here the outcome is deterministic.
P_VALUE_THRESHOLD = 1e-6
# Logits distinct enough that no top-p / min-p boundary of the cases below sits near a rounding error.
FIXED_LOGITS = torch.tensor([2.0, 1.5, 1.2, 0.8, 0.3, 0.0, -0.4, -1.0])


@pytest.fixture(scope="module")
def sampler() -> Sampler:
    record = load_plugins(allow={"default-sampler"}).get("sampler", "default")
    return record.cls()


def make_batch(
    params: Sequence[SamplingParams],
    prompts: Sequence[list[int]] | None = None,
    outputs: Sequence[list[int]] | None = None,
) -> SamplingBatch:
    """A batch whose seeded rows get a fresh CPU generator each, as the engine would make them."""
    return SamplingBatch(
        params=list(params),
        prompt_token_ids=[list(ids) for ids in prompts] if prompts else [[] for _ in params],
        output_token_ids=[list(ids) for ids in outputs] if outputs else [[] for _ in params],
        generators=[None if p.seed is None else torch.Generator().manual_seed(p.seed) for p in params],
    )


def reference_penalized(logits: torch.Tensor, params: SamplingParams, prompt: list[int], output: list[int]):
    """Penalties one token at a time, in float64, straight from their definitions. Ids past the logits (a padded
    embedding table) cannot be emitted and are ignored."""
    x = logits.double().clone()
    prompt, output = [t for t in prompt if t < x.numel()], [t for t in output if t < x.numel()]
    for token in set(prompt) | set(output):
        value = x[token]
        x[token] = value / params.repetition_penalty if value > 0 else value * params.repetition_penalty
    for token, count in Counter(output).items():
        x[token] -= params.presence_penalty + params.frequency_penalty * count
    return x


def reference_probs(logits: torch.Tensor, params: SamplingParams, slack: float = 0.0) -> torch.Tensor:
    """The distribution a row must be drawn from: temperature, top-k, top-p, min-p, renormalized (float64).

    ``slack`` widens the top-p and min-p boundaries so a token on the edge counts as allowed whichever way float32
    rounding took it. Top-k is decided on the same float32 values the sampler sees, so rounding cannot differ.
    """
    scaled = logits.float() / params.temperature
    vocab_size = scaled.numel()
    if 0 < params.top_k < vocab_size:
        kth = scaled.sort(descending=True).values[params.top_k - 1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    probs = scaled.double().softmax(dim=-1)
    if params.top_p < 1:
        # Mass of strictly more likely tokens: a token tied at the boundary may go either way, both are allowed.
        mass_ahead = torch.stack([probs[probs > value].sum() for value in probs])
        probs = probs.masked_fill(mass_ahead >= params.top_p + slack, 0.0)
        probs = probs / probs.sum()
    if params.min_p > 0:
        probs = probs.masked_fill(probs < (params.min_p - slack) * probs.max(), 0.0)
    return probs / probs.sum()


def chi_square_p_value(token_ids: torch.Tensor, probs: torch.Tensor) -> float:
    """P-value of Pearson's goodness-of-fit test of the draws against ``probs``; tokens of probability 0 must not
    appear at all."""
    counts = torch.bincount(token_ids, minlength=probs.numel()).double()
    allowed = probs > 0
    assert counts[~allowed].sum() == 0, f"drew tokens of probability 0: {counts[~allowed].tolist()}"
    expected = probs[allowed] * token_ids.numel()
    assert expected.min() >= 5, "too few draws for the chi-square approximation"
    statistic = ((counts[allowed] - expected) ** 2 / expected).sum()
    dof = allowed.sum().double() - 1
    return float(torch.special.gammaincc(dof / 2, statistic / 2))


def draw_many(sampler: Sampler, logits: torch.Tensor, params: SamplingParams, num_draws: int,
              **history) -> torch.Tensor:
    """``num_draws`` unseeded draws from one row, made as one batch of identical rows."""
    batch = make_batch([params] * num_draws, **{k: [v] * num_draws for k, v in history.items()})
    return sampler.sample(logits.expand(num_draws, -1).clone(), batch).token_ids


def test_registered_through_the_entry_point():
    record = load_plugins(allow={"default-sampler"}).get("sampler", "default")
    assert record.package == "rtx-serve" and record.plugin == "default-sampler"
    supported = set(record.capabilities()["parameters"])
    assert {"temperature", "top_k", "top_p", "min_p", "repetition_penalty", "presence_penalty",
            "frequency_penalty", "seed", "logprobs"} <= supported


def test_greedy_is_argmax_and_consumes_no_randomness(sampler):
    logits = torch.randn(16, 100, generator=torch.Generator().manual_seed(0))
    params = [SamplingParams(temperature=0, top_k=5, top_p=0.5, seed=i if i % 2 else None) for i in range(16)]
    batch = make_batch(params)
    seeded_states = [g.get_state() for g in batch.generators if g is not None]
    rng_state = torch.get_rng_state()

    out = sampler.sample(logits.clone(), batch)

    assert torch.equal(out.token_ids, logits.argmax(dim=-1))
    assert out.logprobs is None and out.top_token_ids is None and out.top_logprobs is None
    assert torch.equal(torch.get_rng_state(), rng_state)
    assert all(torch.equal(g.get_state(), s) for g, s in zip(filter(None, batch.generators), seeded_states))


@pytest.mark.parametrize("cols", [128256, 49152, 50001, 16384])
def test_two_stage_argmax_equals_argmax_ties_included(cols):
    from rtx_plugins.samplers.default import argmax_rows

    logits = torch.randn(5, cols, generator=torch.Generator().manual_seed(cols))
    logits[1, 7] = logits[1, cols - 3] = 100.0  # a tie: the first index wins, as in torch.argmax
    logits[2] = 0.5  # every column ties
    logits[3, -1] = 50.0  # the maximum in the last, possibly padded, chunk
    assert torch.equal(argmax_rows(logits, two_stage=True), logits.argmax(dim=-1))
    assert torch.equal(argmax_rows(logits.bfloat16(), two_stage=True), logits.bfloat16().argmax(dim=-1))


def test_reduced_precision_logits(sampler):
    logits = torch.randn(8, 64, generator=torch.Generator().manual_seed(1)).bfloat16()
    params = [SamplingParams(temperature=0)] * 4 + [SamplingParams(top_k=3, seed=i) for i in range(4)]
    out = sampler.sample(logits.clone(), make_batch(params))
    assert torch.equal(out.token_ids[:4], logits[:4].float().argmax(dim=-1))
    top3 = logits[4:].float().topk(3, dim=-1).indices
    assert (top3 == out.token_ids[4:, None]).any(dim=-1).all()


@pytest.mark.parametrize("params", [
    SamplingParams(top_k=1), SamplingParams(top_p=1e-3), SamplingParams(min_p=1.0), SamplingParams(temperature=1e-4),
    SamplingParams(temperature=1e-320),  # a subnormal: logits divided by it would overflow to infinity
    SamplingParams(top_p=1e-300),  # 0 in a float32 tensor: every token was filtered out, and token 0 drawn
], ids=["top_k=1", "top_p~0", "min_p=1", "tiny-temperature", "subnormal-temperature", "top_p-below-float32"])
def test_settings_that_leave_one_token_act_greedy(sampler, params):
    logits = torch.randn(32, 50, generator=torch.Generator().manual_seed(2))
    assert torch.equal(sampler.sample(logits.clone(), make_batch([params] * 32)).token_ids, logits.argmax(dim=-1))


@pytest.mark.parametrize("params", [
    SamplingParams(top_k=10),
    SamplingParams(top_p=0.6, temperature=1.5),
    SamplingParams(min_p=0.15),
    SamplingParams(top_k=20, top_p=0.9, min_p=0.05, temperature=0.8),
], ids=["top_k", "top_p", "min_p", "all"])
def test_many_draws_stay_in_the_allowed_set(sampler, params):
    torch.manual_seed(3)
    logits = torch.randn(100, generator=torch.Generator().manual_seed(3)) * 2
    allowed = reference_probs(logits, params, slack=1e-5) > 0
    tokens = draw_many(sampler, logits, params, 4000)
    assert allowed[tokens].all()
    assert tokens.unique().numel() > 1  # the filters did not collapse everything to greedy


@settings(max_examples=150, deadline=None, derandomize=True)
@given(
    logits=st.lists(st.floats(-30, 30, width=32), min_size=2, max_size=40),
    temperature=st.floats(0.05, 5.0),
    top_k=st.integers(0, 45),
    top_p=st.floats(0.01, 1.0),
    min_p=st.floats(0.0, 1.0),
)
def test_draws_stay_in_the_allowed_set_for_any_logits(sampler, logits, temperature, top_k, top_p, min_p):
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
    row = torch.tensor(logits)
    torch.manual_seed(4)
    tokens = draw_many(sampler, row, params, 64)
    allowed = reference_probs(row, params, slack=1e-4) > 0
    assert allowed[tokens].all(), f"drew {tokens.unique().tolist()}, allowed {allowed.nonzero().flatten().tolist()}"


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.5),
    SamplingParams(temperature=2.0),
    SamplingParams(temperature=0.8, top_k=5),
    SamplingParams(top_p=0.8),
    SamplingParams(min_p=0.1),
    SamplingParams(temperature=1.3, top_k=6, top_p=0.9, min_p=0.3),
], ids=["T=1", "T=0.5", "T=2", "top_k", "top_p", "min_p", "all-filters"])
def test_empirical_distribution_matches_softmax(sampler, params):
    torch.manual_seed(5)
    tokens = draw_many(sampler, FIXED_LOGITS, params, 20_000)
    assert chi_square_p_value(tokens, reference_probs(FIXED_LOGITS, params)) > P_VALUE_THRESHOLD


@pytest.mark.parametrize("filtered", [
    SamplingParams(top_k=3), SamplingParams(top_k=2, top_p=0.9), SamplingParams(min_p=0.5),
], ids=["top_k", "top_k+top_p", "min_p"])
def test_filters_apply_only_to_their_own_rows(sampler, filtered):
    unfiltered = SamplingParams(temperature=1.0)
    num_draws = 10_000
    batch = make_batch([filtered, unfiltered] * num_draws)
    torch.manual_seed(13)
    tokens = sampler.sample(FIXED_LOGITS.expand(2 * num_draws, -1).clone(), batch).token_ids
    for params, drawn in ((filtered, tokens[0::2]), (unfiltered, tokens[1::2])):
        assert chi_square_p_value(drawn, reference_probs(FIXED_LOGITS, params)) > P_VALUE_THRESHOLD


def test_penalized_distribution_matches_reference(sampler):
    params = SamplingParams(temperature=0.9, repetition_penalty=1.4, presence_penalty=0.5, frequency_penalty=0.3)
    prompt, output = [0, 5, 6], [1, 1, 3, 6]
    torch.manual_seed(6)
    tokens = draw_many(sampler, FIXED_LOGITS, params, 20_000, prompts=prompt, outputs=output)
    expected = reference_probs(reference_penalized(FIXED_LOGITS, params, prompt, output), params)
    assert chi_square_p_value(tokens, expected) > P_VALUE_THRESHOLD


def random_histories(num_rows: int, vocab_size: int, seed: int) -> tuple[list[list[int]], list[list[int]]]:
    gen = torch.Generator().manual_seed(seed)
    # Few distinct ids per history so tokens repeat and frequency counts go above one.
    prompts = [torch.randint(0, vocab_size // 3, (int(torch.randint(0, 12, (1,), generator=gen)),),
                             generator=gen).tolist() for _ in range(num_rows)]
    outputs = [torch.randint(0, vocab_size // 3, (int(torch.randint(0, 12, (1,), generator=gen)),),
                             generator=gen).tolist() for _ in range(num_rows)]
    return prompts, outputs


def penalty_params(num_rows: int, seed: int) -> list[SamplingParams]:
    gen = torch.Generator().manual_seed(seed)
    draws = torch.rand(num_rows, 3, generator=gen).tolist()
    params = [SamplingParams(temperature=0, repetition_penalty=0.5 + 2 * r, presence_penalty=4 * p - 2,
                             frequency_penalty=4 * f - 2) for r, p, f in draws]
    params[0] = SamplingParams(temperature=0)  # a row without penalties next to rows with them
    params[1] = SamplingParams(temperature=0, repetition_penalty=1.7)
    params[2] = SamplingParams(temperature=0, frequency_penalty=1.0)
    return params


def test_penalties_match_reference():
    num_rows, vocab_size = 12, 30
    logits = torch.randn(num_rows, vocab_size, generator=torch.Generator().manual_seed(7)) * 3
    prompts, outputs = random_histories(num_rows, vocab_size, seed=7)
    outputs[3] += [vocab_size, vocab_size + 2]  # beyond the logits: must not spill into the next row
    prompts[5] += [vocab_size + 1]
    params = penalty_params(num_rows, seed=7)
    penalized = apply_penalties(logits.clone(), make_batch(params, prompts, outputs))
    for i in range(num_rows):
        expected = reference_penalized(logits[i], params[i], prompts[i], outputs[i])
        torch.testing.assert_close(penalized[i].double(), expected, rtol=1e-6, atol=1e-6)


@pytest.mark.hf
@pytest.mark.parametrize("penalty", [0.5, 1.3, 2.0])
def test_repetition_penalty_matches_hugging_face(penalty):
    from transformers import RepetitionPenaltyLogitsProcessor

    logits = torch.randn(1, 40, generator=torch.Generator().manual_seed(8)) * 3
    prompt, output = [3, 3, 7, 12, 0, 41], [7, 21, 39, 21, 40]  # 40 and up: past the logits, ignored by both
    expected = RepetitionPenaltyLogitsProcessor(penalty)(torch.tensor([prompt + output]), logits.clone())
    batch = make_batch([SamplingParams(repetition_penalty=penalty)], [prompt], [output])
    torch.testing.assert_close(apply_penalties(logits.clone(), batch), expected)


def test_sampler_applies_penalties_before_greedy_choice(sampler):
    num_rows, vocab_size = 64, 30
    logits = torch.randn(num_rows, vocab_size, generator=torch.Generator().manual_seed(9)) * 3
    prompts, outputs = random_histories(num_rows, vocab_size, seed=9)
    # Put each row's favourite token in its history so the penalties have something to change.
    outputs = [out + [int(row.argmax())] for out, row in zip(outputs, logits)]
    params = penalty_params(num_rows, seed=9)
    tokens = sampler.sample(logits.clone(), make_batch(params, prompts, outputs)).token_ids
    expected = torch.stack([
        reference_penalized(logits[i], params[i], prompts[i], outputs[i]).argmax() for i in range(num_rows)
    ])
    assert torch.equal(tokens, expected)
    assert (expected != logits.argmax(dim=-1)).sum() > num_rows // 4  # not vacuous


def test_logprobs_are_raw_log_softmax(sampler):
    logits = torch.randn(5, 40, generator=torch.Generator().manual_seed(10)) * 2
    params = [
        SamplingParams(temperature=0, logprobs=2, repetition_penalty=2.0),
        SamplingParams(temperature=0.7, top_k=4, seed=1),
        SamplingParams(temperature=1.5, top_p=0.5, min_p=0.1, logprobs=5, presence_penalty=1.0, seed=2),
        SamplingParams(logprobs=0, frequency_penalty=-1.0, seed=3),
        SamplingParams(temperature=0, logprobs=1),
    ]
    prompts, outputs = random_histories(5, 40, seed=10)
    raw = torch.log_softmax(logits, dim=-1)

    out = sampler.sample(logits.clone(), make_batch(params, prompts, outputs))

    torch.testing.assert_close(out.logprobs, raw.gather(1, out.token_ids[:, None]).squeeze(1))
    assert out.top_token_ids.shape == out.top_logprobs.shape == (5, 5)  # widest request, every row
    top = raw.topk(5, dim=-1)
    assert torch.equal(out.top_token_ids, top.indices)
    torch.testing.assert_close(out.top_logprobs, top.values)


def test_seeded_row_is_reproducible_alone_and_anywhere_in_a_batch(sampler):
    vocab_size, num_steps = 50, 6
    gen = torch.Generator().manual_seed(11)
    steps = [torch.randn(6, vocab_size, generator=gen) for _ in range(num_steps)]  # row 0 is the target's logits
    target = SamplingParams(temperature=1.2, top_k=30, seed=1234)
    others = [
        SamplingParams(temperature=0),
        SamplingParams(temperature=0.7),  # unseeded: the default generator
        SamplingParams(temperature=0.9, top_p=0.8, seed=99),
        SamplingParams(repetition_penalty=1.5, frequency_penalty=0.5, min_p=0.05, seed=5),
        SamplingParams(temperature=0, seed=1234),
    ]

    def run(position: int | None) -> tuple[list[int], torch.Tensor]:
        params = [target] if position is None else others[:position] + [target] + others[position:]
        row = 0 if position is None else position
        batch = make_batch(params)
        tokens = []
        for logits in steps:
            rows = logits[:1] if position is None else torch.cat([logits[1:1 + row], logits[:1], logits[1 + row:]])
            chosen = sampler.sample(rows.clone(), batch).token_ids
            for history, token in zip(batch.output_token_ids, chosen.tolist()):
                history.append(token)
            tokens.append(chosen[row].item())
        return tokens, batch.generators[row].get_state()

    rng_state = torch.get_rng_state()
    alone, alone_state = run(None)
    assert torch.equal(torch.get_rng_state(), rng_state), "a seeded row drew from the default generator"
    for position in range(len(others) + 1):
        tokens, state = run(position)
        assert tokens == alone, f"row at position {position}"
        assert torch.equal(state, alone_state), "the generator drew more or less randomness in a batch"
    other_seed = make_batch([SamplingParams(temperature=1.2, top_k=30, seed=4321)])
    assert [sampler.sample(s[:1].clone(), other_seed).token_ids.item() for s in steps] != alone


def test_mixed_batch_gives_each_row_what_it_gets_alone(sampler):
    vocab_size, num_steps = 64, 5
    params = [
        SamplingParams(temperature=0),
        SamplingParams(temperature=0, repetition_penalty=1.3, presence_penalty=0.4),
        SamplingParams(temperature=0.7, top_p=0.9, seed=1),
        SamplingParams(temperature=1.1, min_p=0.05, frequency_penalty=0.6, repetition_penalty=1.2, seed=2),
        SamplingParams(top_k=8, logprobs=3, seed=3),
        SamplingParams(temperature=0, seed=4, logprobs=1),
    ]
    gen = torch.Generator().manual_seed(12)
    steps = [torch.randn(len(params), vocab_size, generator=gen) * 2 for _ in range(num_steps)]
    prompts, _ = random_histories(len(params), vocab_size, seed=12)

    def run(rows: list[int]):
        batch = make_batch([params[i] for i in rows], prompts=[prompts[i] for i in rows])
        tokens, logprobs = [], []
        for logits in steps:
            out = sampler.sample(logits[rows].clone(), batch)
            for history, token in zip(batch.output_token_ids, out.token_ids.tolist()):
                history.append(token)
            tokens.append(out.token_ids)
            logprobs.append(out.logprobs)
        return torch.stack(tokens, dim=1), logprobs

    together, together_logprobs = run(list(range(len(params))))
    for i, p in enumerate(params):
        alone, alone_logprobs = run([i])
        assert torch.equal(together[i], alone[0]), f"row {i}"
        if p.logprobs is not None:
            torch.testing.assert_close(torch.stack([lp[i] for lp in together_logprobs]),
                                       torch.stack([lp[0] for lp in alone_logprobs]))


def test_rejects_logits_that_do_not_match_the_batch(sampler):
    with pytest.raises(ValueError, match="shape"):
        sampler.sample(torch.zeros(3, 10), make_batch([SamplingParams()] * 2))
