"""Resuming a request inside the engine with the tokens it had produced (what a restart from the journal does)."""

from __future__ import annotations

import asyncio

import pytest

from rtxcore.engine.async_engine import AsyncEngine
from rtxcore.errors import InvalidRequestError
from rtxcore.sampling_params import SamplingParams
from tests.helpers.engines import make_engine

PROMPT = [5, 17, 99, 3, 250, 41, 7]
GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)


def run(engine, req_id: str) -> list:
    outputs = []
    while engine.has_unfinished_requests():
        outputs += [o for o in engine.step() if o.req_id == req_id]
    return outputs


@pytest.mark.parametrize("num_done", [1, 9, 23])
def test_a_resumed_greedy_request_continues_exactly_where_it_stopped(registry, num_done):
    engine = make_engine(registry=registry)
    full = engine.generate([PROMPT], GREEDY)[0].token_ids
    engine.add_request(PROMPT, GREEDY, req_id="resumed", output_token_ids=full[:num_done])
    outputs = run(engine, "resumed")
    assert [t for o in outputs for t in o.new_token_ids] == full[num_done:]
    last = outputs[-1]
    # Counted as one request of max_tokens tokens: the usage a client sees is the same as without the restart.
    assert last.finished and last.finish_reason == "length" and last.num_output_tokens == GREEDY.max_tokens
    assert last.num_prompt_tokens == len(PROMPT)


def test_resumed_outputs_are_checked(registry):
    engine = make_engine(registry=registry)
    with pytest.raises(InvalidRequestError, match="output token ids") as bad:
        engine.add_request(PROMPT, GREEDY, output_token_ids=[1, 10_000])
    assert bad.value.param == "output_token_ids"
    with pytest.raises(InvalidRequestError, match="nothing is left to generate"):
        engine.add_request(PROMPT, GREEDY, output_token_ids=list(range(24)))
    assert not engine.has_unfinished_requests()


def test_a_resumed_seeded_request_is_reproducible(registry):
    sampled = SamplingParams(max_tokens=12, temperature=1.0, seed=7, ignore_eos=True)
    engine = make_engine(registry=registry)
    first = engine.generate([PROMPT], sampled)[0].token_ids
    runs = []
    for i in range(2):
        engine.add_request(PROMPT, sampled, req_id=f"r{i}", output_token_ids=first[:5])
        runs.append([t for o in run(engine, f"r{i}") for t in o.new_token_ids])
    assert runs[0] == runs[1] and len(runs[0]) == 7


def test_the_detokenizer_is_caught_up_so_text_and_stop_strings_continue(default_engine):
    prompt = "Once upon a time, in a small village,"
    plain = list(default_engine.stream(prompt, SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)))
    full_text = "".join(o.new_text for o in plain)
    cut = len("".join(o.new_text for o in plain[:8]))
    # A stop string that begins before the restart and ends after it: only a detokenizer that saw the tokens
    # before the restart can find it.
    stop = full_text[cut - 3:cut + 4]
    assert full_text.find(stop) == cut - 3
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True, stop=[stop])
    live = list(default_engine.stream(prompt, params))
    assert live[-1].finish_reason == "stop" and len(live) > 8
    tokens = [t for o in live for t in o.new_token_ids]
    sent_before = "".join(o.new_text for o in live[:8])
    req_id = default_engine.add_request(prompt, params, output_token_ids=tokens[:8])
    resumed = run(default_engine, req_id)
    assert sent_before + "".join(o.new_text for o in resumed) == "".join(o.new_text for o in live)
    assert resumed[-1].finish_reason == "stop" and resumed[-1].stop_reason == stop
    assert [t for o in resumed for t in o.new_token_ids] == tokens[8:]


def test_async_engine_generate_resumes(registry):
    engine = make_engine(registry=registry)
    full = engine.generate([PROMPT], GREEDY)[0].token_ids
    async_engine = AsyncEngine(engine.core)
    async_engine.start()

    async def collect() -> list[int]:
        return [t async for o in async_engine.generate(PROMPT, GREEDY, output_token_ids=full[:4])
                for t in o.new_token_ids]

    try:
        assert asyncio.run(collect()) == full[4:]
    finally:
        async_engine.stop()
