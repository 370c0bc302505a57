"""The benchmark's baseline runs the very same model: HF transformers on our loaded weights gives our tokens."""

from __future__ import annotations

import pytest
import torch

from rtxcore.bench.attention_flops import causal_attention_flops, measure_prefill_attention
from rtxcore.bench.hf_baseline import load_hf_model, run_hf_static
from rtxcore.bench.offline import run_engine
from rtxcore.bench.workloads import get_workload, make_requests
from rtxcore.sampling_params import SamplingParams
from tests.helpers.engines import make_engine


def test_hf_baseline_model_matches_engine_on_dummy_weights(registry):
    engine = make_engine("dummy:tiny", registry=registry)
    hf = load_hf_model(engine.core.source, "cpu", torch.float32)
    requests = make_requests("cpu-small", engine.core.model_config.vocab_size, num_requests=4)
    for r in requests:
        ours = engine.generate([r.prompt_token_ids], SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))
        ids = torch.tensor([r.prompt_token_ids])
        with torch.inference_mode():
            ref = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=16, do_sample=False,
                              pad_token_id=0)
        assert ours[0].token_ids == ref[0, ids.shape[1]:].tolist()


def test_engine_counts_every_requested_token(registry):
    engine = make_engine("dummy:tiny", registry=registry)
    requests = make_requests("cpu-small", engine.core.model_config.vocab_size, seed=3)
    result = run_engine(engine, requests)
    assert result.output_tokens == sum(r.output_len for r in requests)
    static = run_engine(engine, requests, static_batching=True)
    assert static.output_tokens == result.output_tokens


@pytest.mark.parametrize("static_batching", [False, True])
def test_progress_counts_finished_requests(registry, static_batching):
    engine = make_engine("dummy:tiny", registry=registry)
    requests = make_requests("cpu-small", engine.core.model_config.vocab_size, seed=3)
    calls: list[tuple[int, int]] = []
    run_engine(engine, requests, static_batching=static_batching,
               progress=lambda done, total: calls.append((done, total)))
    done = [d for d, _ in calls]
    assert done == sorted(set(done)) and calls[-1] == (len(requests), len(requests)), calls


@pytest.mark.parametrize("static_batching", [False, True])
def test_engine_reports_each_requests_time_to_first_token(registry, static_batching):
    engine = make_engine("dummy:tiny", registry=registry, max_num_seqs=4)
    requests = make_requests("cpu-small", engine.core.model_config.vocab_size, seed=3, num_requests=8)
    result = run_engine(engine, requests, static_batching=static_batching)
    assert len(result.ttft_s) == len(requests)
    assert all(0 < t < result.elapsed_s for t in result.ttft_s)
    ordered = sorted(result.ttft_s)
    # Four run at once: the other four start only as the first ones finish, each after many decode steps.
    assert ordered[4] > ordered[3] and result.ttft_percentile(0.99) == ordered[-1]


def test_hf_baseline_reports_each_batchs_time_to_first_token(registry):
    engine = make_engine("dummy:tiny", registry=registry)
    hf = load_hf_model(engine.core.source, "cpu", torch.float32)
    requests = make_requests("cpu-small", engine.core.model_config.vocab_size, seed=1, num_requests=4)
    result = run_hf_static(hf, requests, batch_size=2)
    assert len(result.ttft_s) == 4 and all(0 < t < result.elapsed_s for t in result.ttft_s)
    # A batch shares its first step; the second batch starts when the whole first one has finished.
    assert result.ttft_s[0] == result.ttft_s[1] < result.ttft_s[2] == result.ttft_s[3]


def test_long_context_workload_is_the_one_shared_workloads_names():
    requests = make_requests("W7", 1000)
    assert len(requests) == 32 and {len(r.prompt_token_ids) for r in requests} == {8192}
    assert {r.output_len for r in requests} == {128}
    assert get_workload("W7").measures_prefill_attention and not get_workload("W1").measures_prefill_attention


def test_causal_attention_flops_count_the_visible_query_key_pairs():
    layers, heads, head_size = 3, 4, 8
    for length in (1, 5, 64):
        visible = int(torch.ones(length, length).tril().sum())
        # Q K^T and P V each make head_size multiply-adds per visible pair, per head and layer.
        expected = 2 * 2 * head_size * visible * heads * layers
        assert causal_attention_flops(length, layers, heads, head_size) == expected


def test_prefill_attention_is_not_measured_off_cuda(registry):
    engine = make_engine("dummy:tiny", registry=registry)
    assert measure_prefill_attention(engine, make_requests("cpu-small", 100, num_requests=1)) is None
