"""Asynchronous scheduling (step N+1 launched before step N's tokens are read) gives exactly the outputs of the
synchronous engine: same tokens, finish reasons and KV bookkeeping, with preemption, prefix caching, stop tokens,
penalties (which fall back to synchronous steps) and aborts. Runs on the CPU, where the mechanism is the same."""

from __future__ import annotations

import random

import pytest

from rtxcore.sampling_params import SamplingParams
from tests.helpers.engines import make_engine


def _prompts(n: int, seed: int, low: int, high: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 500) for _ in range(rng.randint(low, high))] for _ in range(n)]


def _mixed_params(n: int, seed: int) -> list[SamplingParams]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        kind = i % 4
        if kind == 0:
            out.append(SamplingParams(max_tokens=rng.randint(1, 30), temperature=0.0, ignore_eos=True))
        elif kind == 1:  # stops early on a frequent token: the step launched after it is wasted and dropped
            out.append(SamplingParams(max_tokens=40, temperature=0.0, stop_token_ids=[rng.randrange(3, 500)]))
        elif kind == 2:
            out.append(SamplingParams(max_tokens=25, temperature=0.9, top_k=50, seed=i, ignore_eos=True))
        else:
            out.append(SamplingParams(max_tokens=18, temperature=0.0, ignore_eos=True, logprobs=2))
    return out


def _run(registry, async_scheduling: bool, prompts, params, **kwargs):
    engine = make_engine(registry=registry, async_scheduling=async_scheduling, **kwargs)
    results = engine.generate(prompts, params)
    engine.core.kv_cache.check_invariants()
    assert engine.core.kv_cache.num_free_blocks == engine.core.kv_cache.num_usable_blocks
    assert not engine.core.requests and not engine.has_unfinished_requests()
    return [(r.token_ids, r.finish_reason, r.logprobs) for r in results]


def _assert_same(got, expected):
    """Tokens and finish reasons identical; log-probabilities within 1e-5: a wasted row in an asynchronous step
    changes the batch's shape, and with it the last bits of float32 matrix products."""
    assert [(t, f) for t, f, _ in got] == [(t, f) for t, f, _ in expected]
    for (_, _, lps), (_, _, ref) in zip(got, expected):
        assert (lps is None) == (ref is None)
        for lp, r in zip(lps or [], ref or []):
            assert lp.token_id == r.token_id and [t for t, _ in lp.top] == [t for t, _ in r.top]
            assert lp.logprob == pytest.approx(r.logprob, abs=1e-5)
            assert [v for _, v in lp.top] == pytest.approx([v for _, v in r.top], abs=1e-5)


def test_same_outputs_as_synchronous_with_chunked_prefill(registry):
    prompts, params = _prompts(12, 0, 3, 90), _mixed_params(12, 0)
    expected = _run(registry, False, prompts, params, max_num_batched_tokens=48)
    _assert_same(_run(registry, True, prompts, params, max_num_batched_tokens=48), expected)


def test_same_outputs_under_preemption(registry):
    prompts = _prompts(8, 4, 40, 60)
    params = [SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)] * 8
    expected = _run(registry, False, prompts, params, num_kv_blocks=20)
    _assert_same(_run(registry, True, prompts, params, num_kv_blocks=20), expected)


def test_prefix_cache_entries_hold_only_known_tokens(registry):
    # Outputs of the first round are prompts of the second: the cache must have hashed the generated blocks with
    # the tokens' real values, never a placeholder.
    engine = make_engine(registry=registry, async_scheduling=True)
    greedy = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    first = engine.generate(_prompts(4, 7, 20, 30), greedy)
    follow_ups = [r.prompt_token_ids + r.token_ids + [5, 6] for r in first]
    warm = engine.generate(follow_ups, greedy)
    assert all(r.num_cached_tokens >= 48 for r in warm)
    cold = make_engine(registry=registry, enable_prefix_caching=False)
    assert [r.token_ids for r in warm] == [r.token_ids for r in cold.generate(follow_ups, greedy)]


def test_penalties_fall_back_to_synchronous_steps(registry):
    prompts = _prompts(6, 9, 5, 40)
    params = [SamplingParams(max_tokens=20, temperature=0.0, repetition_penalty=1.3, presence_penalty=0.5,
                             ignore_eos=True) if i % 2 else SamplingParams(max_tokens=20, temperature=0.0,
                                                                            ignore_eos=True) for i in range(6)]
    expected = _run(registry, False, prompts, params)
    _assert_same(_run(registry, True, prompts, params), expected)


def test_outputs_come_one_step_later_and_abort_mid_flight_is_clean(registry):
    engine = make_engine(registry=registry, async_scheduling=True)
    greedy = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    a = engine.add_request(_prompts(1, 11, 10, 10)[0], greedy)
    b = engine.add_request(_prompts(1, 12, 10, 10)[0], greedy)
    assert engine.step() == []  # prefill launched; its tokens are read during the next step
    assert {o.req_id for o in engine.step()} == {a, b}
    engine.abort(a)  # its next token is in flight
    seen = []
    while engine.has_unfinished_requests():
        seen += engine.step()
    assert {o.req_id for o in seen} == {b}
    assert sum(len(o.new_token_ids) for o in seen) == 9
    engine.core.kv_cache.check_invariants()
    assert engine.core.kv_cache.num_free_blocks == engine.core.kv_cache.num_usable_blocks
