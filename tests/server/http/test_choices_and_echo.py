"""``n``, ``best_of`` and ``echo`` through the official ``openai`` client against ``rtx serve`` on the default model:
several choices per prompt that differ and are each reproducible, the best of several ranked by log-probability, and
the prompt echoed with its own log-probabilities."""

from __future__ import annotations

import math

import pytest

pytestmark = pytest.mark.model

PROMPT = "The three best things about autumn are"


def _complete(client, **kwargs):
    return client.completions.create(model="smollm2-135m", prompt=PROMPT, **{"max_tokens": 12, "temperature": 1.0,
                                                                             **kwargs})


def test_n_choices_differ_and_each_is_its_seed_plus_index(client):
    three = _complete(client, n=3, seed=40)
    assert [c.index for c in three.choices] == [0, 1, 2]
    texts = [c.text for c in three.choices]
    assert len(set(texts)) > 1, texts
    for j, text in enumerate(texts):
        assert _complete(client, seed=40 + j).choices[0].text == text
    one = _complete(client, seed=40)
    assert three.usage.prompt_tokens == one.usage.prompt_tokens  # the prompt counts once
    assert three.usage.completion_tokens == sum(_complete(client, seed=40 + j).usage.completion_tokens
                                                for j in range(3))


def test_n_choices_per_prompt_in_openai_order(client):
    response = client.completions.create(model="smollm2-135m", prompt=["Red is", "Blue is"], n=2, max_tokens=4,
                                         temperature=1.0, seed=3)
    assert [c.index for c in response.choices] == [0, 1, 2, 3]
    alone = client.completions.create(model="smollm2-135m", prompt="Blue is", n=2, max_tokens=4, temperature=1.0,
                                      seed=3)
    assert [c.text for c in response.choices[2:]] == [c.text for c in alone.choices]


def test_streamed_chat_choices_equal_the_whole_answers(client):
    messages = [{"role": "user", "content": "Name a fruit."}]
    whole = client.chat.completions.create(model="smollm2-135m", messages=messages, n=2, seed=9, max_tokens=10)
    assert len(whole.choices) == 2
    roles: dict[int, str] = {}
    streamed = {0: "", 1: ""}
    finished = set()
    for chunk in client.chat.completions.create(model="smollm2-135m", messages=messages, n=2, seed=9,
                                                max_tokens=10, stream=True):
        for choice in chunk.choices:
            if choice.delta.role:
                roles[choice.index] = choice.delta.role
            streamed[choice.index] += choice.delta.content or ""
            if choice.finish_reason:
                finished.add(choice.index)
    assert roles == {0: "assistant", 1: "assistant"} and finished == {0, 1}
    assert [streamed[0], streamed[1]] == [c.message.content for c in whole.choices]


def test_best_of_returns_the_most_likely_of_its_samples(client):
    samples = _complete(client, n=4, seed=11, logprobs=0)
    totals = [sum(c.logprobs.token_logprobs) for c in samples.choices]
    best = _complete(client, n=1, best_of=4, seed=11)
    assert [c.text for c in best.choices] == [samples.choices[totals.index(max(totals))].text]
    assert best.choices[0].logprobs is None  # ranked by logprobs, which were not asked for
    assert best.usage.completion_tokens == samples.usage.completion_tokens  # all four were sampled
    two = _complete(client, n=2, best_of=4, seed=11, logprobs=0)
    ranked = sorted(range(4), key=lambda i: -totals[i])[:2]
    assert [c.text for c in two.choices] == [samples.choices[i].text for i in ranked]
    assert [c.index for c in two.choices] == [0, 1]


def test_echo_puts_the_prompt_and_its_logprobs_first(client):
    plain = _complete(client, temperature=0.0, max_tokens=5, logprobs=2)
    echoed = _complete(client, temperature=0.0, max_tokens=5, logprobs=2, echo=True)
    choice = echoed.choices[0]
    assert choice.text == PROMPT + plain.choices[0].text
    lp = choice.logprobs
    num_prompt = echoed.usage.prompt_tokens
    assert len(lp.tokens) == num_prompt + 5
    assert "".join(lp.tokens) == choice.text
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(x is not None and x <= 0 for x in lp.token_logprobs[1:])
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    assert lp.token_logprobs[num_prompt:] == plain.choices[0].logprobs.token_logprobs
    # The two most likely at each position, and the prompt's own token among them (a third when it is not one).
    for token, logprob, top in zip(lp.tokens[1:], lp.token_logprobs[1:], lp.top_logprobs[1:]):
        assert len(top) in (2, 3) and max(top.values()) >= logprob - 1e-4
        assert math.isclose(top[token], logprob, abs_tol=1e-4)


def test_echo_streams_the_prompt_in_the_first_chunk(client):
    chunks = list(client.completions.create(model="smollm2-135m", prompt=["One", "Two"], max_tokens=3,
                                            temperature=0.0, echo=True, stream=True))
    first = chunks[0]
    assert [(c.index, c.text) for c in first.choices] == [(0, "One"), (1, "Two")]
    texts = {0: "", 1: ""}
    for chunk in chunks:
        for c in chunk.choices:
            texts[c.index] += c.text
    whole = client.completions.create(model="smollm2-135m", prompt=["One", "Two"], max_tokens=3, temperature=0.0,
                                      echo=True)
    assert [texts[0], texts[1]] == [c.text for c in whole.choices]
