"""Faults that stay small (rtxcore.engine.faults): a plugin raising on one request fails that request alone."""

from __future__ import annotations

import asyncio
import math

import pytest
import torch

from rtx_plugins.samplers.default import DefaultSampler
from rtxcore.contracts.logits_processor import LogitsProcessor, RequestArgumentError
from rtxcore.contracts.proposer import Proposer
from rtxcore.engine.async_engine import AsyncEngine
from rtxcore.engine.config import EngineConfig
from rtxcore.engine.llm import LLM
from rtxcore.engine.speculation.config import SpeculativeConfig
from rtxcore.errors import EngineFailed, InvalidRequestError, RequestError
from rtxcore.hookspecs import hookimpl
from rtxcore.metrics.engine_metrics import EngineMetrics
from rtxcore.registry import load_plugins
from rtxcore.sampling_params import SamplingParams
from tests.helpers.cli import run_in_process
from tests.helpers.engines import make_engine

# The faulty plugins below pick their victim by this top_k (which a greedy request ignores).
MARK = 13


class FlakySampler(DefaultSampler):
    """Raises for the whole batch whenever a marked request that has generated two tokens is in it (mid-stream, when
    the overlapped step has the previous step's tokens in flight)."""

    def sample(self, logits, batch):
        if any(p.top_k == MARK and len(out) >= 2 for p, out in zip(batch.params, batch.output_token_ids)):
            raise RuntimeError("flaky sampler refuses top_k=13")
        return super().sample(logits, batch)


class ExplodingProcessor(LogitsProcessor):
    """Bans nothing; raises on the rows of requests that asked it to."""

    def prepare(self, args):
        return bool(args)

    def new_state(self, prepared, output_token_ids):
        return prepared

    def apply(self, logits, rows):
        if any(r.state for r in rows):
            raise ValueError("exploding processor went off")


class GivingUpProcessor(LogitsProcessor):
    """Bans nothing; gives up on the arguments of requests that asked it to, once they have two tokens (as a grammar
    engine gives up on a grammar it accepted, mid-way)."""

    def prepare(self, args):
        return bool(args)

    def new_state(self, prepared, output_token_ids):
        return [prepared, len(output_token_ids)]

    def advance(self, state, token_ids):
        state[1] += len(token_ids)

    def apply(self, logits, rows):
        if any(r.state[0] and r.state[1] >= 2 for r in rows):
            raise RequestArgumentError("these arguments cannot go on")


class ExplodingProposer(Proposer):
    """Proposes nothing; raises for marked requests once they have a token (after the step that sampled it)."""

    def propose(self, reqs, num_tokens):
        if any(r.params.top_k == MARK and r.num_output_tokens for r in reqs):
            raise RuntimeError("exploding proposer went off")
        return [[] for _ in reqs]


class BlankingProcessor(ExplodingProcessor):
    """Fills its rows with its argument (-inf or NaN) once the request has two tokens: nothing left to sample."""

    def prepare(self, args):
        return float(args)

    def apply(self, logits, rows):
        for r in rows:
            if r.num_generated >= 2:
                logits[r.row] = r.state


class FaultyPlugins:
    @hookimpl
    def register_samplers(self, register):
        register("flaky", FlakySampler)

    @hookimpl
    def register_proposers(self, register):
        register("exploding", ExplodingProposer)

    @hookimpl
    def register_logits_processors(self, register):
        register("exploding", ExplodingProcessor)
        register("giving_up", GivingUpProcessor)
        register("blanking", BlankingProcessor)


@pytest.fixture(scope="module")
def faulty_registry():
    return load_plugins(extra=[("faulty-plugins", FaultyPlugins())])


GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
MARKED = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, top_k=MARK)
PROMPTS = [f"Question {i}: what is {i} plus {i}? Answer:" for i in range(16)]


def test_a_sampler_raising_on_one_request_of_16_fails_it_alone(faulty_registry, default_source):
    engine = LLM(EngineConfig(sampler="flaky"), registry=faulty_registry, source=default_source)
    params = [MARKED if i == 5 else GREEDY for i in range(16)]
    results = engine.generate(PROMPTS, params)
    failed = results[5]
    assert failed.finish_reason == "error"
    assert failed.error is not None and (failed.error.cause, failed.error.plugin) == ("sampler", "flaky")
    assert "refuses top_k=13" in failed.error.message
    others = [r for i, r in enumerate(results) if i != 5]
    reference = engine.generate([p for i, p in enumerate(PROMPTS) if i != 5], GREEDY)
    assert [r.text for r in others] == [r.text for r in reference]
    assert all(r.finish_reason == "length" and len(r.token_ids) == 6 for r in others)
    assert not engine.has_unfinished_requests()
    engine.core.kv_cache.check_invariants()


def test_a_seeded_request_draws_the_same_tokens_when_a_fault_elsewhere_makes_the_step_retry(faulty_registry):
    engine = make_engine(registry=faulty_registry, sampler="flaky")
    seeded = SamplingParams(max_tokens=8, temperature=1.0, seed=7, ignore_eos=True)
    [alone] = engine.generate([[5, 6, 7]], seeded)
    together = engine.generate([[5, 6, 7], [9, 9, 9]], [seeded, MARKED])
    assert together[0].token_ids == alone.token_ids
    assert together[1].finish_reason == "error"


def test_a_logits_processor_raising_fails_only_its_request(faulty_registry):
    engine = make_engine(registry=faulty_registry)
    bad = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, logits_processors={"exploding": True})
    calm = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, logits_processors={"exploding": False})
    results = engine.generate([[1, 2, 3], [4, 5, 6], [7, 8, 9]], [calm, bad, GREEDY])
    assert results[1].finish_reason == "error"
    assert (results[1].error.cause, results[1].error.plugin) == ("logits_processor", "exploding")
    reference = engine.generate([[1, 2, 3], [7, 8, 9]], [calm, GREEDY])
    assert [results[0].token_ids, results[2].token_ids] == [r.token_ids for r in reference]


@pytest.mark.parametrize("async_scheduling", [False, True])
@pytest.mark.parametrize("fill", [float("-inf"), float("nan")])
def test_a_processor_leaving_nothing_to_sample_fails_its_request_not_emitting_garbage(faulty_registry,
                                                                                    async_scheduling, fill):
    engine = make_engine(registry=faulty_registry, async_scheduling=async_scheduling)
    blank = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logits_processors={"blanking": fill})
    results = engine.generate([[1, 2, 3], [4, 5, 6], [7, 8, 9]], [GREEDY, blank, GREEDY])
    failed = results[1]
    assert failed.finish_reason == "error" and len(failed.token_ids) == 2  # the tokens before the blank rows
    assert (failed.error.cause, failed.error.plugin) == ("logits_processor", "blanking")
    assert "left no token to sample" in failed.error.message
    reference = engine.generate([[1, 2, 3], [7, 8, 9]], GREEDY)
    assert [results[0].token_ids, results[2].token_ids] == [r.token_ids for r in reference]
    assert not engine.has_unfinished_requests()
    engine.core.kv_cache.check_invariants()


@pytest.mark.parametrize("steps_before", [1, 2])
def test_a_request_failing_inside_a_verification_step_leaves_the_others_runs_alone(faulty_registry, steps_before):
    # A's rows go blank in the step that verifies B's proposals: A fails there, B keeps every accepted token (its
    # outputs were once paired with the wrong requests by position).
    [reference] = make_engine(registry=faulty_registry).generate([[4, 5, 6]], GREEDY)
    engine = make_engine(registry=faulty_registry, speculative=SpeculativeConfig(method=None))
    blank = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logits_processors={"blanking": -math.inf})
    a = engine.add_request([1, 2, 3], blank)
    outputs = []
    for _ in range(steps_before):
        outputs += engine.step()
    b = engine.add_request([4, 5, 6], GREEDY, draft_token_ids=reference.token_ids)
    while engine.has_unfinished_requests():
        outputs += engine.step()
    finals = {o.req_id: o for o in outputs if o.finished}
    assert finals[a].finish_reason == "error" and "left no token" in finals[a].error.message
    assert [t for o in outputs if o.req_id == b for t in o.new_token_ids] == reference.token_ids
    assert finals[b].finish_reason == "length"
    engine.core.kv_cache.check_invariants()


def test_a_detokenizer_raising_on_one_request_fails_it_alone(default_engine):
    core = default_engine.core
    good = default_engine.add_request("The sky is", GREEDY)
    bad = default_engine.add_request("The sea is", GREEDY)

    class BrokenDetokenizer:
        def update(self, token_ids):
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "invalid start byte")

    core.output_processor._detokenizers[bad] = BrokenDetokenizer()
    outputs = []
    while default_engine.has_unfinished_requests():
        outputs += default_engine.step()
    [failed] = [o for o in outputs if o.req_id == bad]
    assert failed.finish_reason == "error" and failed.error.cause == "detokenizer"
    finals = [o for o in outputs if o.req_id == good and o.finished]
    assert finals and finals[0].finish_reason == "length"


def _fail_backend(engine: LLM, times: int, error: type[Exception] = torch.cuda.OutOfMemoryError) -> list[int]:
    """Make the backend's next ``times`` execute calls raise; returns the list of calls that raised."""
    backend = engine.core.backend
    real, raised = backend.execute, []

    def execute(batch):
        if len(raised) < times:
            raised.append(batch.num_tokens)
            raise error("CUDA out of memory (injected)" if error is torch.cuda.OutOfMemoryError else "injected")
        return real(batch)
    backend.execute = execute
    return raised


def test_a_backend_step_failing_once_is_retried_and_nobody_notices(tiny_engine):
    reference = tiny_engine.generate([[1, 2, 3], [4, 5]], GREEDY)
    raised = _fail_backend(tiny_engine, 1)
    results = tiny_engine.generate([[1, 2, 3], [4, 5]], GREEDY)
    assert len(raised) == 1
    assert [r.token_ids for r in results] == [r.token_ids for r in reference]


def test_a_backend_step_failing_twice_fails_its_requests_and_the_engine_goes_on(tiny_engine):
    raised = _fail_backend(tiny_engine, 2)
    results = tiny_engine.generate([[1, 2, 3], [4, 5]], GREEDY)
    assert len(raised) == 2
    assert [(r.finish_reason, r.error.cause) for r in results] == [("error", "backend")] * 2
    [after] = tiny_engine.generate([[1, 2, 3]], GREEDY)
    assert after.finish_reason == "length" and len(after.token_ids) == 6
    tiny_engine.core.kv_cache.check_invariants()


def test_backend_steps_failing_in_a_row_give_up_on_the_engine(tiny_engine):
    _fail_backend(tiny_engine, 4)
    tiny_engine.add_request([1, 2, 3], GREEDY)
    tiny_engine.add_request([4, 5, 6], GREEDY)
    tiny_engine.step()  # its requests fail
    tiny_engine.add_request([7, 8, 9], GREEDY)
    with pytest.raises(EngineFailed, match="2 steps in a row"):
        tiny_engine.step()


def _serve_beside_a_good_request(registry, params: SamplingParams, **engine_options):
    """A greedy request and one with ``params`` served together; returns the good one's outputs, what the other
    ended with, the engine and its metrics."""
    metrics = EngineMetrics("tiny")
    engine = AsyncEngine(make_engine(registry=registry, **engine_options).core, [metrics.observer()])
    engine.start()

    async def run(p):
        return [out async for out in engine.generate([1, 2, 3], p)]

    async def both():
        return await asyncio.gather(run(GREEDY), run(params), return_exceptions=True)
    try:
        good, bad = asyncio.run(both())
    finally:
        engine.stop()
    return good, bad, engine, metrics.render()[0].decode()


def test_a_served_request_a_plugin_fails_on_ends_with_an_error_naming_it(faulty_registry):
    good, bad, engine, text = _serve_beside_a_good_request(faulty_registry, MARKED, sampler="flaky")
    assert good[-1].finish_reason == "length"
    assert isinstance(bad, RequestError) and bad.reason == "plugin_failed"
    assert "sampler plugin 'flaky'" in bad.message
    assert engine.error is None
    assert 'rtx_request_failures_total{cause="sampler",model="tiny",plugin="flaky"} 1.0' in text
    assert 'rtx_requests_finished_total{finish_reason="error",model="tiny"} 1.0' in text


def test_a_proposer_failing_after_a_step_sampled_leaves_one_output_per_request(faulty_registry):
    # The proposer runs after the step's tokens are applied: the request's token of that step and its failure come
    # out as one final output (the metrics took a second, unfinished one of a request already gone for an error).
    engine = make_engine(registry=faulty_registry, speculative=SpeculativeConfig(method="exploding"))
    engine.add_request([1, 2, 3], GREEDY)
    bad = engine.add_request([4, 5, 6], MARKED)
    steps = []
    while engine.has_unfinished_requests():
        steps.append(engine.step())
    assert all(len({o.req_id for o in outs}) == len(outs) for outs in steps)
    [final] = [o for outs in steps for o in outs if o.req_id == bad]
    assert final.finished and final.error.plugin == "exploding" and final.new_token_ids
    assert final.timings is not None and final.timings.first_token_time is not None

    good, failed, served, text = _serve_beside_a_good_request(
        faulty_registry, MARKED, speculative=SpeculativeConfig(method="exploding"))
    assert good[-1].finish_reason == "length" and served.error is None
    assert isinstance(failed, RequestError) and "proposer plugin 'exploding'" in failed.message
    assert 'rtx_requests_finished_total{finish_reason="error",model="tiny"} 1.0' in text


@pytest.mark.model
def test_rtx_generate_exits_1_naming_the_plugin_that_failed_its_request(faulty_registry, monkeypatch):
    import rtxcore.cli.generate

    def load_engine(config):
        config.speculative = SpeculativeConfig(method="exploding")
        return LLM(config, registry=faulty_registry)
    monkeypatch.setattr(rtxcore.cli.generate, "load_engine", load_engine)
    proc = run_in_process("generate", "The sky is", "--max-tokens", "6", "--top-k", str(MARK))
    assert proc.returncode == 1 and proc.stdout.strip()  # the token before the failure was written
    assert proc.stderr.splitlines()[-1] == ("rtx: error: proposer plugin 'exploding' failed on this request: "
                                            "RuntimeError: exploding proposer went off")


def test_arguments_a_processor_gives_up_on_are_the_clients_error_naming_the_field(faulty_registry):
    giving_up = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logits_processors={"giving_up": True})
    good, bad, engine, text = _serve_beside_a_good_request(faulty_registry, giving_up)
    assert good[-1].finish_reason == "length"
    assert isinstance(bad, InvalidRequestError) and bad.param == "logits_processors", bad
    assert bad.message == "logits_processors: these arguments cannot go on"
    assert engine.error is None
    assert 'cause="logits_processor",model="tiny",plugin="giving_up"} 1.0' in text


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_faults_are_isolated_in_the_serial_and_the_overlapped_step(faulty_registry, async_scheduling):
    engine = make_engine(registry=faulty_registry, sampler="flaky", async_scheduling=async_scheduling)
    prompts = [[1, 2, 3], [4, 5, 6], [7, 8, 9], [10, 11]]
    reference = engine.generate(prompts, GREEDY)
    _fail_backend(engine, 1)
    results = engine.generate(prompts + [[3, 3, 3]], [GREEDY] * 4 + [MARKED])
    assert [r.token_ids for r in results[:4]] == [r.token_ids for r in reference]
    assert results[4].finish_reason == "error" and len(results[4].token_ids) == 2
    assert not engine.has_unfinished_requests()
    engine.core.kv_cache.check_invariants()


def test_out_of_memory_steps_are_counted_in_metrics(tiny_engine):
    from prometheus_client.parser import text_string_to_metric_families

    from rtxcore.metrics import EngineMetrics

    metrics = EngineMetrics("tiny")
    observer = metrics.observer()

    def oom_total() -> float:
        observer.on_idle(tiny_engine.core)
        samples = (s for f in text_string_to_metric_families(metrics.render()[0].decode()) for s in f.samples)
        return sum(s.value for s in samples if s.name == "rtx_oom_total")

    assert oom_total() == 0
    _fail_backend(tiny_engine, 2)  # out of memory twice: the step and its retry
    tiny_engine.generate([[1, 2, 3]], GREEDY)
    assert oom_total() == 2
    _fail_backend(tiny_engine, 1, RuntimeError)  # retried, and not an out-of-memory failure
    [result] = tiny_engine.generate([[1, 2, 3]], GREEDY)
    assert result.finish_reason == "length" and oom_total() == 2
