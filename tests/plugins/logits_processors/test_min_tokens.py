"""min_tokens: neither an end-of-sequence token, a stop token nor a stop string ends a request before it has that
many tokens, in the serial and the overlapped step and with speculative decoding; bad values are refused naming
the field."""

from __future__ import annotations

import pytest

from rtxcore.engine.speculation.config import SpeculativeConfig
from rtxcore.errors import InvalidRequestError
from rtxcore.sampling_params import SamplingParams
from tests.helpers.engines import make_engine

PROMPTS = [[5, 9, 13], [21, 22], [31, 32, 33, 34], [40]]
STOP = 7


def _eager_to_stop(min_tokens: int) -> SamplingParams:
    # The stop token is the greedy choice at every step (logit_bias): only min_tokens holds it back.
    return SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True, stop_token_ids=[STOP],
                          logit_bias={STOP: 100}, min_tokens=min_tokens)


def _run(llm, params, per_request=None):
    per_request = per_request or {}
    ids = [llm.add_request(p, sp, **per_request.get(i, {})) for i, (p, sp) in enumerate(zip(PROMPTS, params))]
    tokens: dict[str, list[int]] = {i: [] for i in ids}
    reasons = {}
    while llm.core.has_unfinished_requests():
        for out in llm.core.step():
            tokens[out.req_id] += out.new_token_ids
            if out.finished:
                reasons[out.req_id] = out.finish_reason
    return [(tokens[i], reasons[i]) for i in ids]


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_stop_token_waits_for_min_tokens(registry, async_scheduling):
    # A mixed batch: no minimum, minimums of several lengths (one running into max_tokens), in one engine whose
    # steps overlap or not. The count a row is masked by includes the tokens an overlapped step has not read yet.
    minimums = [0, 3, 9, 20]
    llm = make_engine(registry=registry, async_scheduling=async_scheduling)
    results = _run(llm, [_eager_to_stop(m) for m in minimums])
    for m, (tokens, reason) in zip(minimums, results):
        if m < 20:
            assert tokens[:m] and STOP not in tokens[:m] or m == 0
            assert tokens[m:] == [STOP] and reason == "stop", (m, tokens)
        else:
            assert STOP not in tokens and len(tokens) == 20 and reason == "length"


def test_verification_masks_each_proposed_row_by_its_own_count():
    # Caller-supplied drafts: full of the stop token (rejected below the minimum), or the plain output itself (all
    # accepted: the row after the last one below the minimum may, and does, sample the stop token).
    minimums = (0, 3, 9, 5)
    expected = _run(make_engine(), [_eager_to_stop(m) for m in minimums])
    llm = make_engine(speculative=SpeculativeConfig(method=None))
    drafts = {i: {"draft_token_ids": [STOP] * 6 if i % 2 else expected[i][0]} for i in range(len(PROMPTS))}
    assert _run(llm, [_eager_to_stop(m) for m in minimums], drafts) == expected
    assert sum(s.num_verifications for s in llm.core.speculator.stats.values()) > 0


@pytest.mark.model
def test_end_of_sequence_and_stop_strings_wait_for_min_tokens(default_engine):
    chat = default_engine.inputs.apply_chat_template([{"role": "user", "content": "Say just the word hello."}])
    [short] = default_engine.generate([chat], SamplingParams(max_tokens=40, temperature=0.0))
    [held] = default_engine.generate([chat], SamplingParams(max_tokens=40, temperature=0.0, min_tokens=15))
    assert short.finish_reason == held.finish_reason == "stop" and len(short.token_ids) < 15
    assert held.token_ids[:len(short.token_ids) - 1] == short.token_ids[:-1]  # the same until EOS was held back
    assert len(held.token_ids) >= 15

    prompt = "Q: What is 2+2?\nA:"
    [free] = default_engine.generate([prompt], SamplingParams(max_tokens=30, temperature=0.0))
    [cut] = default_engine.generate([prompt], SamplingParams(max_tokens=30, temperature=0.0, stop=["\n"]))
    [late] = default_engine.generate([prompt], SamplingParams(max_tokens=30, temperature=0.0, stop=["\n"],
                                                              min_tokens=12))
    assert cut.text == free.text[:free.text.index("\n")]
    # A stop string counts once it ends in the text of a token past the twelfth.
    before = default_engine.tokenizer.decode(free.token_ids[:12])
    assert "\n" in before  # else this test would not show the minimum at work
    assert late.text == free.text[:free.text.index("\n", len(before))] and late.finish_reason == "stop"


def test_a_row_left_only_ending_tokens_keeps_them(tiny_engine):
    # Another processor allows nothing but the stop token: holding it back would leave nothing to sample (the
    # sampler would draw token 0 from a row of -inf). It is sampled and ends the output, short of the minimum,
    # whichever processor a batch names first (min_tokens applies last).
    params = SamplingParams(max_tokens=8, temperature=0.0, stop_token_ids=[STOP], allowed_token_ids=[STOP],
                            min_tokens=3)
    first = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, min_tokens=2)
    results = tiny_engine.generate([[4, 4], [5, 9, 13]], [first, params])
    assert results[1].token_ids == [STOP] and results[1].finish_reason == "stop"


@pytest.mark.model
def test_a_complete_grammar_ends_the_output_before_the_minimum(default_engine):
    # The grammar allows nothing but the end after "yes": the output ends there, whatever the minimum.
    params = SamplingParams(max_tokens=12, temperature=0.0, min_tokens=8, structured_output={"choice": ["yes"]})
    [result] = default_engine.generate(["Answer yes or no: is the sky blue?"], params)
    assert result.text == "yes" and result.finish_reason == "stop" and len(result.token_ids) <= 2


@pytest.mark.parametrize(("params", "field"), [
    ({"min_tokens": -1}, "min_tokens"),
    ({"min_tokens": 3, "max_tokens": 2}, "min_tokens"),
    ({"min_tokens": "3"}, "min_tokens"),
    ({"min_tokens": True}, "min_tokens"),
    ({"min_tokens": 2, "logits_processors": {"min_tokens": 2}}, "logits_processors"),
])
def test_bad_minimums_name_the_field(params, field):
    with pytest.raises(InvalidRequestError) as info:
        SamplingParams(**{"max_tokens": 8, **params})
    assert info.value.param == field


def test_the_processor_alone_takes_a_count_or_its_fields(tiny_engine):
    # Through the logits_processors map, as a third party's client would name it.
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=False, stop_token_ids=[STOP],
                            logit_bias={STOP: 100}, logits_processors={"min_tokens": {"min_tokens": 4,
                                                                                      "stop_token_ids": [STOP]}})
    [result] = tiny_engine.generate([[5, 9, 13]], params)
    assert result.token_ids[4:] == [STOP] and STOP not in result.token_ids[:4]
    for bad in ({"min_tokens": -2}, {"min_tokens": 2, "stop": "x"}, "four"):
        # Named as the built-in's field, as every built-in processor's arguments are.
        with pytest.raises(InvalidRequestError, match="^min_tokens: ") as info:
            tiny_engine.generate([[4]], SamplingParams(max_tokens=2, logits_processors={"min_tokens": bad}))
        assert info.value.param == "min_tokens"
