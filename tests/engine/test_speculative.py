"""Speculative decoding in the engine: every proposer leaves greedy output unchanged (stops inside accepted runs
included), rejection sampling keeps the target's distribution, and preemption, prefix caching, KV tiers and lanes
keep working with it on."""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import pytest
import torch

from rtxcore.contracts.proposer import Proposer
from rtxcore.engine.speculation.config import SpeculativeConfig
from rtxcore.errors import ConfigError, InvalidRequestError
from rtxcore.hookspecs import hookimpl
from rtxcore.registry import load_plugins
from rtxcore.sampling_params import SamplingParams
from tests.helpers.engines import make_engine

# A text to repeat: the input-grounded kind of work where proposals from the prompt get accepted.
PASSAGE = (
    "The lighthouse keeper climbed the spiral stairs every evening at dusk. He carried a small brass lamp, a "
    "notebook with a cracked leather cover, and a flask of tea that his sister had made that morning. At the top "
    "he wiped the great lens, checked the clockwork that turned it, and wrote the time, the wind and the state of "
    "the sea in the notebook, as his father had done for forty years before him."
)
REPEAT = f"Copy the following text exactly.\n\nText: {PASSAGE}\n\nCopy: "


# Exact comparisons run in float32: in bfloat16 a verification (several positions in one pass) and a plain step (one)
# may round a near-tie differently on an accelerator.
EXACT = {"dtype": "float32"}


def _params(**kwargs) -> SamplingParams:
    return SamplingParams(**{"temperature": 0.0, "max_tokens": 28, **kwargs})


def _run(llm, prompts, params, per_request=None):
    """Run to completion; ``per_request``: extra add_request keywords by request index."""
    per_request = per_request or {}
    ids = [llm.add_request(p, sp, **per_request.get(i, {})) for i, (p, sp) in enumerate(zip(prompts, params))]
    results = {i: [] for i in ids}
    finals = {}
    while llm.core.has_unfinished_requests():
        for out in llm.core.step():
            results[out.req_id] += out.new_token_ids
            if out.finished:
                finals[out.req_id] = (out.finish_reason, out.stop_reason)
    return [(results[i], finals[i]) for i in ids]


@pytest.fixture(scope="module")
def plain_default():
    return make_engine(None)


@pytest.fixture(scope="module")
def mixed_batch(plain_default):
    """Four greedy requests and their plain outputs: a long copy, the copy cut by a stop string from the middle of
    its own output, a copy cut by max_tokens, and a short question that may end on EOS."""
    tokenizer = plain_default.tokenizer
    copy = _run(plain_default, [REPEAT], [_params()])[0][0]
    text = tokenizer.decode(copy)
    stop = text[len(text) // 2:len(text) // 2 + 6]
    prompts = [REPEAT, REPEAT, REPEAT, "Q: What is the capital of France?\nA:"]
    params = [_params(), _params(stop=[stop]), _params(max_tokens=7), _params(max_tokens=16)]
    return prompts, params, _run(plain_default, prompts, params), copy


@pytest.mark.model
@pytest.mark.parametrize("method,options", [
    ("ngram", {}),
    ("layer-skip", {}),
    ("draft", {"draft_model": "smollm2-135m"}),  # the target as its own draft: every proposal must be accepted
])
def test_greedy_output_is_unchanged_by_each_proposer(mixed_batch, method, options):
    prompts, params, expected, _ = mixed_batch
    # The draft is the whole target: two proposals a step keep its share of the test's time small.
    k = 2 if method == "draft" else 4
    llm = make_engine(None, speculative=SpeculativeConfig(method=method, options=options, num_speculative_tokens=k))
    assert _run(llm, prompts, params) == expected
    stats = llm.core.speculator.stats[method]
    assert stats.num_verifications > 0
    if method == "ngram":
        assert stats.num_accepted_tokens > 0
    if method == "draft":
        assert stats.num_accepted_tokens == stats.num_proposed_tokens > 0
    llm.core.kv_cache.check_invariants()


@pytest.mark.model
def test_caller_supplied_tokens_are_verified_and_stop_inside_accepted_runs(plain_default, mixed_batch):
    prompts, params, expected, copy = mixed_batch
    llm = make_engine(None)  # no proposer configured: requests bring their own tokens
    kwargs = {i: {"draft_token_ids": copy} for i in range(3)}
    assert _run(llm, prompts, params, kwargs) == expected
    stats = llm.core.speculator.stats["assisted"]
    # The prediction is the output itself: every proposal is accepted, so the stop string and max_tokens ended
    # their requests inside accepted runs.
    assert stats.num_accepted_tokens == stats.num_proposed_tokens > 0
    # A prediction that departs from the output costs nothing in correctness.
    wrong = copy[:5] + [t + 1 for t in copy[5:12]] + copy[12:]
    assert _run(llm, prompts[:1], params[:1], {0: {"draft_token_ids": wrong}}) == expected[:1]
    # Opted out: nothing proposed.
    before = stats.num_proposed_tokens
    assert _run(llm, prompts[:1], params[:1], {0: {"draft_token_ids": copy, "speculative": False}}) == expected[:1]
    assert llm.core.speculator.stats["assisted"].num_proposed_tokens == before


class GarbageProposer(Proposer):
    """Proposes random tokens, out-of-vocabulary ids among them."""

    def __init__(self, context):
        super().__init__(context)
        self.rng = np.random.default_rng(0)
        self.vocab_size = context.backend.model_config.vocab_size

    def propose(self, reqs, num_tokens):
        return [[int(t) for t in self.rng.integers(0, self.vocab_size + 3, size=k)] for k in num_tokens]


class GarbagePlugin:
    @hookimpl
    def register_proposers(self, register):
        register("garbage", GarbageProposer)


def _tiny_batch():
    rng = np.random.default_rng(1)
    prompts = []
    for n in (12, 40, 70, 25, 33):
        head = rng.integers(3, 500, size=n).tolist()
        prompts.append(head + head[: n // 2])  # a repeat, so prompt lookup has something to propose
    params = [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True) for m in (30, 18, 41, 9, 27)]
    return prompts, params


def test_garbage_proposals_cost_no_correctness():
    registry = load_plugins(extra=[("garbage", GarbagePlugin())])
    prompts, params = _tiny_batch()
    expected = _run(make_engine(registry=registry, **EXACT), prompts, params)
    llm = make_engine(registry=registry, speculative=SpeculativeConfig(method="garbage", adaptive=False,
                                                                        min_acceptance=0.0), **EXACT)
    assert _run(llm, prompts, params) == expected
    assert llm.core.speculator.stats["garbage"].num_verifications > 0


def test_an_option_a_proposer_does_not_list_is_refused():
    # GarbageProposer lists no options and reads none: a mistyped option would otherwise go unnoticed.
    registry = load_plugins(extra=[("garbage", GarbagePlugin())])
    with pytest.raises(ConfigError, match=r"unknown garbage option 'bogus' \(options: none\)"):
        make_engine(registry=registry, speculative=SpeculativeConfig(method="garbage", options={"bogus": 1}))
    with pytest.raises(ConfigError, match=r"unknown ngram option 'lookup' \(options: prompt_lookup_min, "):
        make_engine(speculative=SpeculativeConfig(method="ngram", options={"lookup": 3}))


@pytest.mark.parametrize("setting", [
    {"num_kv_blocks": 14},  # preemption
    {"kv_host_bytes": 4 << 20, "num_kv_blocks": 24},  # evicted prefix blocks go to host memory and come back
    {"scheduler": "sla-lanes"},
    {"max_num_batched_tokens": 20},  # chunked prefill, and verifications cut short by the budget
])
def test_speculation_keeps_engine_features_working(setting):
    prompts, params = _tiny_batch()
    prompts = prompts + prompts  # the second half hits the prefix cache
    params = params + params
    expected = _run(make_engine(**setting, **EXACT), prompts, params)
    # The tiny random model accepts little of prompt lookup: the plain outputs as predictions make sure runs of
    # accepted tokens (and their KV) are exercised alongside rejections.
    for method in ("ngram", None):
        llm = make_engine(speculative=SpeculativeConfig(method=method), **setting, **EXACT)
        kwargs = {i: {"draft_token_ids": out} for i, (out, _) in enumerate(expected) if method is None and i % 2}
        assert _run(llm, prompts, params, kwargs) == expected
        core = llm.core
        core.kv_cache.check_invariants()
        assert core.kv_cache.num_free_blocks == core.kv_cache.num_usable_blocks
        assert sum(s.num_verifications for s in core.speculator.stats.values()) > 0
        if "num_kv_blocks" in setting and "kv_host_bytes" not in setting:
            assert core.scheduler.num_running == 0
    if "kv_host_bytes" in setting:
        assert core.kv_cache.stats.num_reloaded_tokens > 0
    else:
        assert core.kv_cache.stats.num_prefix_hit_tokens > 0


def test_rejection_sampling_keeps_the_target_distribution():
    """Chi-square on a small vocabulary (top-k 6): the first token of a sampled request whose proposal is a fixed
    token, and the next one after an accepted proposal, follow the target's distribution (significance 0.001)."""
    torch.manual_seed(0)
    prompt = [5, 17, 42, 99, 7, 300]
    params = SamplingParams(max_tokens=2, temperature=1.0, top_k=6, ignore_eos=True, logprobs=6)
    plain = make_engine()
    first = _top_distribution(plain, prompt, params)
    proposed = sorted(first, key=first.get)[len(first) // 2]  # a token of middling probability
    second = _top_distribution(plain, prompt + [proposed], params)

    llm = make_engine(max_num_seqs=256)
    n = 3000
    firsts, seconds = [], []
    for _ in range(0, n, 250):
        outs = _run(llm, [prompt] * 250, [params] * 250, {i: {"draft_token_ids": [proposed]} for i in range(250)})
        for tokens, _ in outs:
            firsts.append(tokens[0])
            if tokens[0] == proposed:
                seconds.append(tokens[1])
    stats = llm.core.speculator.stats["assisted"]
    assert stats.num_verifications == n and 0 < stats.num_accepted_tokens < n
    _chi_square_ok(firsts, first)
    _chi_square_ok(seconds, second)


def _top_distribution(llm, prompt, params) -> dict[int, float]:
    """The target's distribution of the next token under ``params`` (temperature 1, top-k): its top-k raw
    logprobs, renormalized."""
    rid = llm.add_request(prompt, SamplingParams(max_tokens=1, temperature=0.0, logprobs=params.top_k))
    # With overlapped steps (an accelerator) a step's outputs come back with the next one.
    out = next(o for _ in range(3) for o in llm.core.step() if o.req_id == rid)
    alternatives = out.logprobs[0].top[:params.top_k]
    total = sum(math.exp(lp) for _, lp in alternatives)
    return {token: math.exp(lp) / total for token, lp in alternatives}


# Critical values of the chi-square distribution at significance 0.001 by degrees of freedom.
_CHI2_CRITICAL_0_001 = {1: 10.83, 2: 13.82, 3: 16.27, 4: 18.47, 5: 20.52, 6: 22.46, 7: 24.32}


def _chi_square_ok(samples: list[int], expected: dict[int, float]) -> None:
    assert set(samples) <= set(expected), f"drew tokens outside the top-k: {set(samples) - set(expected)}"
    n = len(samples)
    counts = {t: samples.count(t) for t in expected}
    statistic = sum((counts[t] - n * p) ** 2 / (n * p) for t, p in expected.items())
    assert statistic < _CHI2_CRITICAL_0_001[len(expected) - 1], (statistic, counts, expected)


def test_early_exit_emits_confident_drafted_tokens_and_is_refused_where_it_cannot_run():
    prompts, params = _tiny_batch()
    spec = SpeculativeConfig(method="layer-skip", options={"exit_layer": 1}, adaptive=False, min_acceptance=0.0)
    llm = make_engine(speculative=spec, **EXACT)
    expected = _run(make_engine(**EXACT), prompts, params)
    # A threshold no draft reaches keeps the full model's tokens.
    strict = [replace(p, early_exit_threshold=1.0) for p in params]
    assert _run(llm, prompts, strict) == expected
    assert llm.core.speculator.num_early_exits == 0
    # One every draft reaches: each drafted token stands, so every run is accepted in full.
    stats = llm.core.speculator.stats["layer-skip"]
    proposed, accepted = stats.num_proposed_tokens, stats.num_accepted_tokens
    loose = [replace(p, early_exit_threshold=1e-9) for p in params]
    outs = _run(llm, prompts, loose)
    assert [len(tokens) for tokens, _ in outs] == [p.max_tokens for p in params]
    assert stats.num_accepted_tokens - accepted == stats.num_proposed_tokens - proposed > 0
    assert llm.core.speculator.num_early_exits > 0 and outs != expected
    llm.core.kv_cache.check_invariants()
    with pytest.raises(InvalidRequestError, match="logprobs"):
        llm.add_request(prompts[0], replace(params[0], early_exit_threshold=0.5, logprobs=1))
    with pytest.raises(InvalidRequestError, match="layer-skip") as err:
        make_engine().add_request(prompts[0], replace(params[0], early_exit_threshold=0.5))
    assert err.value.param == "early_exit_threshold"
    assert stats.num_verifications > 0
