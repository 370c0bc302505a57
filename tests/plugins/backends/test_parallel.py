"""Tensor and pipeline parallelism on the CPU (gloo): split ranks give the tokens one process gives."""

from __future__ import annotations

import multiprocessing
import os
import random
import socket
import subprocess
import sys
import textwrap

import pytest
import torch

from rtx_plugins.backends.torch_backend.parallel import pipeline
from rtxcore.contracts.backend import ForwardBatch
from rtxcore.errors import ConfigError, EngineFailed
from rtxcore.sampling_params import SamplingParams
from tests.helpers import REPO
from tests.helpers.engines import make_engine

# Chunked prefill (a 32-token budget), preemption (12 blocks of 16 tokens for six requests growing to 90 tokens)
# and prefix caching (two prompts twice) in one run; float32 so the splits round alike.
SETTINGS = dict(device="cpu", dtype="float32", max_num_batched_tokens=32, num_kv_blocks=12)


def mixed_batch() -> tuple[list[list[int]], list[SamplingParams]]:
    rng = random.Random(7)
    prompts = [[rng.randrange(3, 500) for _ in range(n)] for n in (5, 40, 17, 60)]
    prompts += [prompts[1], prompts[3]]
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in (30, 12, 25, 8, 20, 16)]
    return prompts, params


def run(engine, prompts, params) -> tuple[list[list[int]], bool]:
    ids = [engine.add_request(p, sp) for p, sp in zip(prompts, params)]
    tokens: dict[str, list[int]] = {i: [] for i in ids}
    preempted = False
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens[out.req_id] += out.new_token_ids
        preempted |= any(r.num_preemptions for r in engine.core.requests.values())
    return [tokens[i] for i in ids], preempted


@pytest.fixture(scope="module")
def one_process_tokens() -> list[list[int]]:
    tokens, _ = run(make_engine(**SETTINGS), *mixed_batch())
    return tokens


@pytest.mark.parametrize("tp, pp", [(2, 1), (1, 2), (2, 2)], ids=["tp2", "pp2", "tp2xpp2"])
def test_split_ranks_give_the_tokens_of_one_process(registry, monkeypatch, one_process_tokens, tp, pp):
    # Every step of two or more requests is cut into micro-batches (one per stage), so stages overlap in the test.
    monkeypatch.setenv("RTX_PP_MICRO_BATCH_TOKENS", "1")
    cuts = []
    real = pipeline.count_micro_batches
    monkeypatch.setattr(pipeline, "count_micro_batches", lambda *a: cuts.append(real(*a)) or cuts[-1])
    prompts, params = mixed_batch()
    engine = make_engine(registry=registry, tensor_parallel_size=tp, pipeline_parallel_size=pp, **SETTINGS)
    try:
        got, preempted = run(engine, prompts, params)
        assert engine.core.kv_cache.num_free_blocks == engine.core.kv_cache.num_usable_blocks
    finally:
        engine.core.backend.close()
    assert got == one_process_tokens
    assert [len(t) for t in got] == [sp.max_tokens for sp in params]
    assert preempted, "12 blocks must force preemption, or the test checks less than it claims"
    if pp > 1:
        assert max(cuts) == pp, "steps must have been cut into one micro-batch per stage"


def _batch(lengths: list[int], logits_at: list[int]) -> ForwardBatch:
    starts = [sum(lengths[:i]) for i in range(len(lengths) + 1)]
    n = starts[-1]
    return ForwardBatch(input_ids=torch.arange(n), positions=torch.arange(n), query_start_loc=starts,
                        seq_lens=[x + 3 for x in lengths], block_tables=torch.arange(len(lengths) * 2,
                                                                                     dtype=torch.int32).view(-1, 2),
                        slot_mapping=torch.arange(100, 100 + n), logits_indices=torch.tensor(logits_at),
                        num_decodes=2)


def test_micro_batches_cover_the_step_in_order():
    # Two decodes, then prompt chunks of 10, 3 and 6 tokens; the 10-token chunk samples nothing.
    batch = _batch([1, 1, 10, 3, 6], [0, 1, 14, 20])
    parts = pipeline.split(batch, 3)
    assert len(parts) == 3 and all(p.batch.num_reqs for p in parts)
    assert torch.cat([p.batch.input_ids for p in parts]).tolist() == batch.input_ids.tolist()
    assert torch.cat([p.batch.slot_mapping for p in parts]).tolist() == batch.slot_mapping.tolist()
    assert sum((p.batch.seq_lens for p in parts), []) == batch.seq_lens
    assert torch.cat([p.batch.block_tables for p in parts]).tolist() == batch.block_tables.tolist()
    assert sum(p.batch.num_decodes for p in parts) == 2
    # Each logits row comes from exactly one micro-batch, at the same token.
    rows = sorted(r for p in parts for r in p.logit_rows)
    assert rows == [0, 1, 2, 3]
    for p in parts:
        start = batch.query_start_loc[batch.seq_lens.index(p.batch.seq_lens[0])]
        assert [batch.logits_indices[r].item() - start for r in p.logit_rows] == p.batch.logits_indices.tolist()


def test_small_steps_are_not_cut():
    batch = _batch([1, 1, 1, 1], [0, 1, 2, 3])
    assert pipeline.count_micro_batches(batch, pp_size=2, min_tokens=256) == 1
    assert pipeline.count_micro_batches(batch, pp_size=2, min_tokens=2) == 2
    assert pipeline.count_micro_batches(_batch([5], [4]), pp_size=4, min_tokens=1) == 1  # one request: one part


@pytest.mark.parametrize("sizes, message", [
    # dummy:tiny has 4 attention heads, 2 KV heads and 2 layers; refused before any worker starts.
    (dict(tensor_parallel_size=3), r"tensor_parallel_size 3 .* attention heads \(4\)"),
    (dict(pipeline_parallel_size=3), r"pipeline_parallel_size 3 does not divide the model's layers \(2\)"),
    (dict(tensor_parallel_size=0), "tensor_parallel_size must be at least 1"),
    (dict(pipeline_parallel_size=0), "pipeline_parallel_size must be at least 1"),
    (dict(pipeline_parallel_size=2, nnodes=2), "needs dist_init_addr"),
    (dict(pipeline_parallel_size=2, nnodes=3, dist_init_addr="h:1"), "nnodes 3 does not divide the 2 ranks"),
    (dict(pipeline_parallel_size=2, nnodes=2, dist_init_addr="nohost"), "is not host:port"),
    (dict(nnodes=1, node_rank=1), "node_rank must be in 0..nnodes-1"),
])
def test_sizes_that_do_not_fit_are_refused(sizes, message):
    with pytest.raises(ConfigError, match=message):
        make_engine(device="cpu", **sizes)


@pytest.mark.parametrize("flag, error", [
    ("--tensor-parallel-size", "tensor_parallel_size 3 does not divide the model's attention heads (4)"),
    ("--pipeline-parallel-size", "pipeline_parallel_size 3 does not divide the model's layers (2)"),
])
def test_cli_refuses_a_bad_size_in_one_line(capsys, flag, error):
    from rtxcore.cli.main import EXIT_USAGE, main

    assert main(["generate", "--model", "dummy:tiny", "--device", "cpu", flag, "3", "1 2 3"]) == EXIT_USAGE
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == f"rtx: error: {error}"


def test_a_dead_worker_makes_rank_0_raise(registry):
    engine = make_engine(registry=registry, tensor_parallel_size=2, device="cpu", num_kv_blocks=16)
    try:
        [worker] = [p for p in multiprocessing.active_children() if p.name == "rtx-rank1"]
        worker.kill()
        worker.join(10)
        engine.add_request([5, 6, 7], SamplingParams(max_tokens=4))
        # Not a fault to retry (rtxcore.engine.faults): the engine gives up at once.
        with pytest.raises(EngineFailed, match="worker rank 1 .* exited"):
            engine.step()
    finally:
        engine.core.backend.close()


TORCHRUN_SCRIPT = """
from rtxcore.sampling_params import SamplingParams
from tests.helpers.engines import make_engine

engine = make_engine(pipeline_parallel_size={pp}, device="cpu", num_kv_blocks=32)
out = engine.generate([[5, 6, 7, 8], list(range(10, 50))], SamplingParams(max_tokens=10, temperature=0.0,
                                                                          ignore_eos=True))
print("TOKENS", [r.token_ids for r in out], flush=True)
"""


def test_ranks_started_by_torchrun(tmp_path):
    # Every rank runs the same script: rank 0 prints the tokens, rank 1's backend.load() serves and exits.
    script = tmp_path / "pp.py"
    outputs = []
    for pp, launcher in ((1, []), (2, ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"])):
        script.write_text(textwrap.dedent(TORCHRUN_SCRIPT.format(pp=pp)))
        done = subprocess.run([sys.executable, *launcher, str(script)], capture_output=True, text=True, timeout=120,
                              cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)})
        assert done.returncode == 0, done.stderr[-2000:]
        outputs.append([line for line in done.stdout.splitlines() if line.startswith("TOKENS")])
    assert len(outputs[1]) == 1 and outputs[1] == outputs[0]


def test_a_second_node_joins_at_the_rendezvous_address(registry, one_process_tokens):
    # Two "nodes" on one machine: node 1 is `rtx generate --node-rank 1`, which only runs rank 1 (the second
    # pipeline stage) and exits when node 0 (this process) shuts its engine down.
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        addr = f"127.0.0.1:{s.getsockname()[1]}"
    node1 = subprocess.Popen(
        [sys.executable, "-m", "rtxcore.cli.main", "generate", "--model", "dummy:tiny", "--device", "cpu",
         "--dtype", "float32", "--pipeline-parallel-size", "2", "--nnodes", "2", "--node-rank", "1",
         "--dist-init-addr", addr, "unused"], cwd=REPO, stderr=subprocess.PIPE, text=True)
    try:
        engine = make_engine(registry=registry, pipeline_parallel_size=2, nnodes=2, dist_init_addr=addr, **SETTINGS)
        try:
            got, _ = run(engine, *mixed_batch())
        finally:
            engine.core.backend.close()
        assert node1.wait(60) == 0, node1.stderr.read()[-2000:]
    finally:
        node1.kill()
    assert got == one_process_tokens
    assert "node 1 of 2: running ranks 1..1" in node1.stderr.read()


def test_quantized_checkpoints_are_cut_per_rank(registry):
    # Stored forms (as rtx quantize writes them) loaded by two tensor-parallel ranks: each cuts its rows or
    # columns out of them, and the tokens are one process's on the same checkpoint (int8 keeps activations in
    # float, so only the order of the sums differs).
    from tests.helpers.quantized_source import QuantizedDummySource

    prompts, params = mixed_batch()
    source = QuantizedDummySource("tiny", "int8")
    expected, _ = run(make_engine(registry=registry, source=source, **SETTINGS), prompts, params)
    engine = make_engine(registry=registry, source=source, tensor_parallel_size=2, **SETTINGS)
    try:
        got, _ = run(engine, prompts, params)
    finally:
        engine.core.backend.close()
    assert got == expected


def test_fp8_checkpoint_logits_split_in_two_stay_close(registry):
    # fp8 also quantizes activations, per token, over the columns a rank holds: a row-parallel layer's two halves
    # get scales of their own, so two ranks round slightly differently from one. Close, not equal.
    from tests.helpers.quantized_source import QuantizedDummySource

    source = QuantizedDummySource("tiny", "fp8")
    prompt = list(range(5, 45))
    batch = ForwardBatch.prefill(prompt, [0, 1, 2], 16, torch.tensor([len(prompt) - 1]))
    logits = []
    for tp in (1, 2):
        engine = make_engine(registry=registry, source=source, tensor_parallel_size=tp, device="cpu", num_kv_blocks=4)
        try:
            logits.append(engine.core.backend.execute(batch)[0])
        finally:
            engine.core.backend.close()
    one, two = logits
    assert torch.nn.functional.cosine_similarity(one, two, dim=0) > 0.99
    assert (one - two).norm() < 0.1 * one.norm()


def test_int4_columns_are_cut_on_group_boundaries(registry):
    quantizer = registry.create("quantizer", "int4")
    weight = torch.randn(16, 256)
    qt = quantizer.quantize(weight)  # groups of 128 input features
    whole = quantizer.dequantize(qt)
    assert torch.equal(quantizer.dequantize(quantizer.slice_inputs(qt, 128, 128)), whole[:, 128:])
    with pytest.raises(ValueError, match="cannot be cut at 64..192"):
        quantizer.slice_inputs(qt, 64, 128)
    # A method without slice_inputs says so.
    from rtxcore.contracts.quantizer import Quantizer

    with pytest.raises(ValueError, match="cannot be split along their input features"):
        Quantizer.slice_inputs(quantizer, qt, 0, 128)


def test_more_ranks_than_gpus_is_refused(monkeypatch):
    from rtx_plugins.backends.torch_backend.parallel import launch

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    launch.check_devices(torch.device("cuda"), 2)
    launch.check_devices(torch.device("cpu"), 8)  # CPU ranks share the host
    with pytest.raises(ConfigError, match="is 4 ranks, one GPU each, but only 2 CUDA devices are visible"):
        launch.check_devices(torch.device("cuda"), 4)


def test_the_default_models_gguf_splits_over_three_ranks(registry, default_source):
    # The default model is a GGUF file whose index holds a memory map: the source crosses to the spawned ranks as
    # its path, each rank mapping the file again. Its 9 heads and 3 KV heads split three ways.
    prompt = default_source.tokenizer().encode("The capital of France is")
    params = [SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)]
    settings = dict(device="cpu", dtype="float32", num_kv_blocks=8)
    expected, _ = run(make_engine(registry=registry, source=default_source, **settings), [prompt], params)
    engine = make_engine(registry=registry, source=default_source, tensor_parallel_size=3, **settings)
    try:
        got, _ = run(engine, [prompt], params)
    finally:
        engine.core.backend.close()
    assert got == expected and len(got[0]) == 6
