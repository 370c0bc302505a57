"""Tensor parallelism on the CPU (gloo, spawned workers): two ranks give the tokens one rank gives."""

from __future__ import annotations

import multiprocessing
import os
import random
import subprocess
import sys
import textwrap

import pytest

from rtxcore.errors import ConfigError
from rtxcore.sampling_params import SamplingParams
from tests.helpers import REPO
from tests.helpers.engines import make_engine

# Chunked prefill (a 32-token budget), preemption (12 blocks of 16 tokens for six requests growing to 90 tokens)
# and prefix caching (two prompts twice) in one run; float32 so the two splits round alike.
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


def test_two_ranks_give_the_tokens_of_one(registry):
    prompts, params = mixed_batch()
    expected, _ = run(make_engine(registry=registry, **SETTINGS), prompts, params)
    engine = make_engine(registry=registry, tensor_parallel_size=2, **SETTINGS)
    try:
        got, preempted = run(engine, prompts, params)
        assert engine.core.kv_cache.num_free_blocks == engine.core.kv_cache.num_usable_blocks
    finally:
        engine.core.backend.close()
    assert got == expected
    assert [len(t) for t in got] == [sp.max_tokens for sp in params]
    assert preempted, "12 blocks must force preemption, or the test checks less than it claims"


def test_size_that_does_not_divide_the_heads_is_refused():
    # dummy:tiny has 4 attention heads, 2 KV heads: 3 divides neither; refused before any worker starts.
    with pytest.raises(ConfigError, match=r"tensor_parallel_size 3 .* attention heads \(4\)"):
        make_engine(tensor_parallel_size=3, device="cpu")


def test_size_below_one_is_refused():
    with pytest.raises(ConfigError, match="tensor_parallel_size"):
        make_engine(tensor_parallel_size=0)


def test_a_dead_worker_makes_rank_0_raise(registry):
    engine = make_engine(registry=registry, tensor_parallel_size=2, device="cpu", num_kv_blocks=16)
    try:
        [worker] = [p for p in multiprocessing.active_children() if p.name == "rtx-tp-rank1"]
        worker.kill()
        worker.join(10)
        engine.add_request([5, 6, 7], SamplingParams(max_tokens=4))
        with pytest.raises(RuntimeError, match="worker rank 1 .* exited"):
            engine.step()
    finally:
        engine.core.backend.close()


def test_cli_refuses_a_bad_size_in_one_line(capsys):
    from rtxcore.cli.main import EXIT_USAGE, main

    assert main(["generate", "--model", "dummy:tiny", "--device", "cpu", "--tensor-parallel-size", "3", "1 2 3"]) \
        == EXIT_USAGE
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == "rtx: error: tensor_parallel_size 3 does not divide the model's attention heads (4)"


TORCHRUN_SCRIPT = """
from rtxcore.sampling_params import SamplingParams
from tests.helpers.engines import make_engine

engine = make_engine(tensor_parallel_size={tp}, device="cpu", num_kv_blocks=32)
out = engine.generate([[5, 6, 7, 8], list(range(10, 50))], SamplingParams(max_tokens=10, temperature=0.0,
                                                                          ignore_eos=True))
print("TOKENS", [r.token_ids for r in out], flush=True)
"""


def test_ranks_started_by_torchrun(tmp_path):
    # Every rank runs the same script: rank 0 prints the tokens, rank 1's backend.load() serves and exits.
    script = tmp_path / "tp.py"
    outputs = []
    for tp, launcher in ((1, []), (2, ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"])):
        script.write_text(textwrap.dedent(TORCHRUN_SCRIPT.format(tp=tp)))
        done = subprocess.run([sys.executable, *launcher, str(script)], capture_output=True, text=True, timeout=120,
                              cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)})
        assert done.returncode == 0, done.stderr[-2000:]
        outputs.append([line for line in done.stdout.splitlines() if line.startswith("TOKENS")])
    assert len(outputs[1]) == 1 and outputs[1] == outputs[0]
