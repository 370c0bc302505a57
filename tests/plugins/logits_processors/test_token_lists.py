"""logit_bias, allowed and banned tokens, on a random-weight model (no tokenizer: prompts are token ids)."""

from __future__ import annotations

import json

import pytest

from rtxcore.engine.outputs import LOGPROB_FLOOR
from rtxcore.errors import InvalidRequestError
from rtxcore.sampling_params import SamplingParams


def _greedy(engine, prompt: list[int], **params) -> list[int]:
    [result] = engine.generate([prompt], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, **params))
    return result.token_ids


def test_logit_bias_forces_and_forbids_a_token(tiny_engine):
    plain = _greedy(tiny_engine, [5, 9, 13])
    forced = _greedy(tiny_engine, [5, 9, 13], logit_bias={"7": 100})
    assert forced == [7] * 6
    forbidden = _greedy(tiny_engine, [5, 9, 13], logit_bias={plain[0]: -100})
    assert forbidden[0] != plain[0]


def test_allowed_tokens_bound_every_step(tiny_engine):
    allowed = [3, 11, 42]
    out = _greedy(tiny_engine, [5, 9, 13], allowed_token_ids=allowed)
    assert set(out) <= set(allowed)
    # Sampled too, not only greedy.
    [sampled] = tiny_engine.generate([[5, 6]], SamplingParams(max_tokens=12, temperature=1.5, seed=1,
                                                                 ignore_eos=True, allowed_token_ids=allowed))
    assert set(sampled.token_ids) <= set(allowed)


def test_banned_tokens_never_appear(tiny_engine):
    plain = _greedy(tiny_engine, [5, 9, 13])
    banned = sorted(set(plain))
    out = _greedy(tiny_engine, [5, 9, 13], banned_token_ids=banned)
    assert not set(out) & set(banned)


def test_processors_apply_to_their_rows_only(tiny_engine):
    # One batch: a request with a processor beside two without; the others' tokens are those they get alone.
    alone = [_greedy(tiny_engine, p) for p in ([21, 22], [31, 32, 33])]
    params = [SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True),
              SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logit_bias={5: 100}),
              SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)]
    results = tiny_engine.generate([[21, 22], [5, 6], [31, 32, 33]], params)
    assert [results[0].token_ids, results[2].token_ids] == alone
    assert results[1].token_ids == [5] * 6


@pytest.mark.parametrize(("params", "field"), [
    ({"logit_bias": {"x": 1}}, "logit_bias"),
    ({"logit_bias": {1: 101}}, "logit_bias"),
    ({"logit_bias": {10**9: 1}}, "logit_bias"),
    ({"allowed_token_ids": []}, "allowed_token_ids"),
    ({"allowed_token_ids": [10**9]}, "allowed_token_ids"),
    ({"banned_token_ids": ["a"]}, "banned_token_ids"),
    ({"logits_processors": {"no-such": {}}}, "logits_processors"),
])
def test_bad_arguments_name_the_field(tiny_engine, params, field):
    with pytest.raises(InvalidRequestError) as info:
        tiny_engine.generate([[4]], SamplingParams(max_tokens=2, **params))
    assert info.value.param == field


def test_nothing_left_to_sample_is_refused(tiny_engine):
    # Banning every allowed token, or the whole vocabulary, leaves the sampler nothing: a 400 naming the ban, not
    # a request that quietly emits a banned token.
    vocab = tiny_engine.core.backend.model_config.vocab_size
    for params in ({"allowed_token_ids": [5, 6], "banned_token_ids": [6, 5, 7]},
                   {"banned_token_ids": list(range(vocab))}):
        with pytest.raises(InvalidRequestError, match="nothing could be sampled") as info:
            tiny_engine.generate([[4]], SamplingParams(max_tokens=2, **params))
        assert info.value.param == "banned_token_ids"


def test_forbidden_alternatives_have_a_finite_logprob(tiny_engine):
    # With one token allowed, the other top alternatives are impossible (-inf): reported at the floor, so that a
    # response stays valid JSON (json.dumps would write -Infinity, a 500 in a JSON response).
    [result] = tiny_engine.generate([[4, 8]], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True,
                                                              allowed_token_ids=[7], logprobs=3))
    assert result.token_ids == [7, 7, 7]
    for lp in result.logprobs:
        assert lp.logprob == 0.0
        assert [p for _, p in lp.top][1:] == [LOGPROB_FLOOR, LOGPROB_FLOOR]
        json.dumps([lp.logprob, lp.top], allow_nan=False)
