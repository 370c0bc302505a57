"""Engine behaviour on a tiny random-weight model: batching, chunked prefill, prefix caching, preemption, errors."""

from __future__ import annotations

import random

import pytest

from rtxcore.errors import CapacityError, InvalidRequestError
from rtxcore.sampling_params import SamplingParams
from tests.helpers.engines import make_engine

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


def prompts(n: int, seed: int = 0, low: int = 3, high: int = 90) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 500) for _ in range(rng.randint(low, high))] for _ in range(n)]


def alone(engine, prompt, params=GREEDY) -> list[int]:
    return engine.generate([prompt], params)[0].token_ids


def test_batch_of_16_mixed_lengths_equals_each_alone(registry):
    engine = make_engine(registry=registry, enable_prefix_caching=False)
    batch = prompts(16)
    together = [r.token_ids for r in engine.generate(batch, GREEDY)]
    assert together == [alone(engine, p) for p in batch]
    assert all(len(t) == GREEDY.max_tokens for t in together)


def test_prefix_cache_hit_gives_same_tokens_as_miss(registry):
    engine = make_engine(registry=registry)
    shared = prompts(1, seed=1, low=70, high=70)[0]
    first = engine.generate([shared + [7, 8, 9]], GREEDY)[0]
    second = engine.generate([shared + [7, 8, 9]], GREEDY)[0]
    assert first.num_cached_tokens == 0
    assert second.num_cached_tokens == 64  # 4 full blocks of 16; the last partial block is recomputed
    assert second.token_ids == first.token_ids
    cold = make_engine(registry=registry, enable_prefix_caching=False)
    assert alone(cold, shared + [7, 8, 9]) == first.token_ids


def test_chunked_prefill_matches_and_never_stalls_decodes(registry):
    engine = make_engine(registry=registry, max_num_batched_tokens=32, enable_prefix_caching=False)
    short, long = prompts(1, seed=2, low=5, high=5)[0], prompts(1, seed=3, low=200, high=200)[0]
    engine.add_request(short, GREEDY, req_id="short")
    engine.step()  # prefill of the short prompt; it decodes from now on
    engine.add_request(long, GREEDY, req_id="long")
    decoded_while_long_prefills = 0
    while engine.core.requests["long"].num_computed_tokens < len(long):
        outs = engine.step()
        decoded_while_long_prefills += any(o.req_id == "short" for o in outs)
        if "short" not in engine.core.requests:
            break
    assert decoded_while_long_prefills >= 5
    while engine.has_unfinished_requests():
        engine.step()
    reference = make_engine(registry=registry, enable_prefix_caching=False)
    assert engine.generate([long], GREEDY)[0].token_ids == alone(reference, long)


def test_preemption_recomputes_and_outputs_match(registry):
    batch = prompts(8, seed=4, low=40, high=60)
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    roomy = make_engine(registry=registry, enable_prefix_caching=False)
    expected = [r.token_ids for r in roomy.generate(batch, params)]
    # 20 blocks of 16 tokens hold about three of these requests at full length.
    tight = make_engine(registry=registry, num_kv_blocks=20, enable_prefix_caching=False)
    got = [r.token_ids for r in tight.generate(batch, params)]
    assert got == expected
    assert tight.core.kv_cache.num_free_blocks == tight.core.kv_cache.num_usable_blocks


def test_preemption_counted(registry):
    tight = make_engine(registry=registry, num_kv_blocks=12)
    params = SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True)
    ids = [tight.add_request(p, params) for p in prompts(6, seed=5, low=30, high=40)]
    preempted = set()
    while tight.has_unfinished_requests():
        tight.step()
        preempted |= {r.req_id for r in tight.core.requests.values() if r.num_preemptions}
    assert preempted, "a cache of 12 blocks must force preemption"
    assert len(ids) == 6


def test_request_that_can_never_fit_is_refused_clearly(registry):
    engine = make_engine(registry=registry, num_kv_blocks=4)
    with pytest.raises(CapacityError, match="KV cache"):
        engine.add_request(list(range(10, 60)), SamplingParams(max_tokens=40))
    with pytest.raises(CapacityError, match="context"):
        make_engine(registry=registry, max_model_len=64).add_request(list(range(10, 80)), GREEDY)
    assert not engine.has_unfinished_requests()


@pytest.mark.parametrize("prompt, params, match", [
    ([], GREEDY, "prompt is empty"),
    ([5, 99999], GREEDY, "token ids"),
    ("text", GREEDY, "no tokenizer"),
])
def test_bad_prompts_raise_without_side_effects(tiny_engine, prompt, params, match):
    with pytest.raises(InvalidRequestError, match=match):
        tiny_engine.add_request(prompt, params)
    assert not tiny_engine.has_unfinished_requests()


@pytest.mark.parametrize("kwargs, match", [
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": -3}, "max_tokens"),
    ({"temperature": -0.5}, "temperature"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"top_k": -1}, "top_k"),
    ({"min_p": 2.0}, "min_p"),
    # a seen token's logit divided by 1e-38 overflowed float32, and sampling drew tokens the model all but excluded
    ({"repetition_penalty": 1e-38}, "repetition_penalty"),
    ({"repetition_penalty": 1e4}, "repetition_penalty"),
    # a built-in through the map skipped its field's checks (allowed tokens all banned, and token 0 sampled), or
    # was given twice with the map's silently winning
    ({"allowed_token_ids": [5], "logits_processors": {"banned_tokens": [5]}}, "logits_processors"),
    ({"logit_bias": {"1": 1}, "logits_processors": {"logit_bias": {"2": 1}}}, "logits_processors"),
    ({"seed": -2**63 - 1}, "seed"),
    ({"seed": 2**63}, "seed"),
    # bool is an int in Python: these passed once and then broke the sampler on the engine's thread
    ({"top_k": True}, "top_k"),
    ({"seed": True}, "seed"),
    ({"logprobs": False}, "logprobs"),
    ({"max_tokens": True}, "max_tokens"),
    ({"stop_token_ids": [True]}, "stop_token_ids"),
    ({"ignore_eos": "false"}, "ignore_eos"),
    ({"skip_special_tokens": 0}, "skip_special_tokens"),
])
def test_bad_sampling_params_name_the_field(kwargs, match):
    with pytest.raises(InvalidRequestError, match=match) as info:
        SamplingParams(**kwargs)
    assert info.value.param == match


def test_a_negative_seed_is_taken_modulo_and_reproducible(tiny_engine):
    # OpenAI's and vLLM's seeds are any int64.
    params = SamplingParams(max_tokens=8, temperature=1.0, seed=-5, ignore_eos=True)
    assert params.seed == 2**63 - 5
    first, second = (tiny_engine.generate([[4, 5, 6]], params)[0].token_ids for _ in range(2))
    assert first == second


def test_bad_requests_do_not_disturb_running_ones(registry):
    engine = make_engine(registry=registry)
    good = prompts(3, seed=6)
    expected = [alone(engine, p) for p in good]
    engine.core.kv_cache.reset_prefix_cache()
    ids = [engine.add_request(p, GREEDY) for p in good]
    results = {i: [] for i in ids}
    for step in range(200):
        if step % 3 == 0:
            for bad in ([], [1, 10**9]):
                with pytest.raises(InvalidRequestError):
                    engine.add_request(bad, GREEDY)
            with pytest.raises(CapacityError):
                engine.add_request([5] * 3000, GREEDY)
        for out in engine.step():
            results[out.req_id].extend(out.new_token_ids)
        if not engine.has_unfinished_requests():
            break
    assert [results[i] for i in ids] == expected


def test_same_seed_same_output_and_batch_independent(registry):
    engine = make_engine(registry=registry)
    params = SamplingParams(max_tokens=20, temperature=1.0, seed=1234, ignore_eos=True)
    p = prompts(1, seed=7)[0]
    a = alone(engine, p, params)
    others = prompts(5, seed=8)
    mixed = engine.generate(others[:2] + [p] + others[2:],
                            [SamplingParams(max_tokens=20, temperature=1.0, ignore_eos=True)] * 2 + [params]
                            + [SamplingParams(max_tokens=20, temperature=0.8, seed=9, ignore_eos=True)] * 3)
    assert mixed[2].token_ids == a
    other_seed = alone(engine, p, SamplingParams(max_tokens=20, temperature=1.0, seed=4321, ignore_eos=True))
    assert other_seed != a


def test_max_tokens_stop_token_ids_and_logprobs(tiny_engine):
    p = prompts(1, seed=10)[0]
    free = alone(tiny_engine, p, SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True))
    stop_at = free[4]
    stopped = tiny_engine.generate([p], SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True,
                                                       stop_token_ids=[stop_at]))[0]
    assert stopped.token_ids == free[: free.index(stop_at) + 1]
    assert stopped.finish_reason == "stop"
    res = tiny_engine.generate([p], SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True, logprobs=3))[0]
    assert res.finish_reason == "length" and len(res.token_ids) == 5
    assert [lp.token_id for lp in res.logprobs] == res.token_ids
    for lp in res.logprobs:
        assert len(lp.top) == 3 and lp.top[0][0] == lp.token_id  # greedy picks the most likely token
        assert lp.logprob <= 0 and lp.top[0][1] >= lp.top[1][1] >= lp.top[2][1]


def test_abort_frees_blocks(tiny_engine):
    req_id = tiny_engine.add_request(prompts(1, seed=11, low=80, high=80)[0], SamplingParams(max_tokens=50))
    tiny_engine.step()
    assert tiny_engine.core.kv_cache.num_free_blocks < tiny_engine.core.kv_cache.num_usable_blocks
    out = tiny_engine.abort(req_id)
    assert out.finished and out.finish_reason == "abort"
    assert not tiny_engine.has_unfinished_requests()
    assert tiny_engine.core.kv_cache.num_free_blocks == tiny_engine.core.kv_cache.num_usable_blocks
