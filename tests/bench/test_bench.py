"""The benchmark's baseline runs the very same model: HF transformers on our loaded weights gives our tokens."""

from __future__ import annotations

import pytest
import torch

from rtxcore.bench.hf_baseline import load_hf_model
from rtxcore.bench.offline import run_engine
from rtxcore.bench.workloads import make_requests
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
