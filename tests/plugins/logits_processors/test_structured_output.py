"""Structured output on the real default model: every kind of grammar holds, in batches, under speculation, after a
restart, and a grammar the engine refuses is named."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from rtxcore.engine.config import EngineConfig
from rtxcore.engine.llm import LLM
from rtxcore.engine.speculation.config import SpeculativeConfig
from rtxcore.engine.speculation.speculator import GRAMMAR
from rtxcore.errors import InvalidRequestError
from rtxcore.sampling_params import SamplingParams

pytestmark = pytest.mark.model

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 3},
    },
    "required": ["name", "age", "role"],
    "additionalProperties": False,
}
PROMPTS = ["Describe a person as JSON.", "Give me a user record.", "A JSON object for Ada Lovelace:",
           "Make up a guest."]


def _chat(engine, text: str) -> str:
    return engine.inputs.apply_chat_template([{"role": "user", "content": text}])


def _run(engine, prompts, structured, **params) -> list:
    defaults = {"max_tokens": 80, "temperature": 0.0}
    return engine.generate([_chat(engine, p) for p in prompts],
                           SamplingParams(structured_output=structured, **{**defaults, **params}))


def test_json_schema_output_validates_and_stops(default_engine):
    for result in _run(default_engine, PROMPTS, {"json": PERSON}):
        jsonschema.validate(json.loads(result.text), PERSON)
        assert result.finish_reason == "stop"


def test_sampled_json_still_validates(default_engine):
    results = _run(default_engine, PROMPTS[:2], {"json": PERSON}, temperature=1.0, seed=3)
    for result in results:
        jsonschema.validate(json.loads(result.text), PERSON)


def test_json_object_regex_choice_and_grammar(default_engine):
    [obj] = _run(default_engine, ["Answer in JSON."], {"json_object": True})
    assert isinstance(json.loads(obj.text), dict)
    pattern = r"\d{4}-\d{2}-\d{2}"
    [date] = _run(default_engine, ["When did it happen?"], {"regex": pattern})
    assert re.fullmatch(pattern, date.text)
    choices = ["red", "green", "blue"]
    [color] = _run(default_engine, ["Pick a colour."], {"choice": choices})
    assert color.text in choices
    # Bounded, so the grammar itself ends the output (an unbounded one is cut by max_tokens).
    grammar = 'root ::= num ("+" | "*") num\nnum ::= [1-9] [0-9]?'
    [expr] = _run(default_engine, ["Write a sum."], {"grammar": grammar}, max_tokens=12)
    assert re.fullmatch(r"[1-9][0-9]?[+*][1-9][0-9]?", expr.text)
    assert expr.finish_reason == "stop"


def test_guided_and_free_requests_share_a_batch(default_engine):
    free = SamplingParams(max_tokens=12, temperature=0.0)
    guided = SamplingParams(max_tokens=12, temperature=0.0, structured_output={"choice": ["yes", "no"]})
    prompts = [_chat(default_engine, "Is the sky blue?"), _chat(default_engine, "Name a fruit.")]
    alone = default_engine.generate([prompts[1]], free)[0].token_ids
    both = default_engine.generate(prompts, [guided, free])
    assert both[0].text in ("yes", "no")
    if default_engine.core.backend.device.type == "cpu":
        # In float32 on the CPU a request's tokens do not depend on its batch; bfloat16 GPU kernels chosen by batch
        # size round differently, so there the free request is only checked to run.
        assert both[1].token_ids == alone
    assert both[1].token_ids


def test_resumed_request_continues_the_grammar(default_engine):
    params = SamplingParams(max_tokens=60, temperature=0.0, structured_output={"json": PERSON})
    prompt = _chat(default_engine, PROMPTS[0])
    [whole] = default_engine.generate([prompt], params)
    cut = whole.token_ids[:7]
    req = default_engine.inputs.make_request(prompt, params, "resumed", output_token_ids=cut)
    default_engine.core.add_request(req)
    tokens = list(cut)
    while default_engine.has_unfinished_requests():
        for out in default_engine.step():
            tokens += out.new_token_ids
    assert tokens == whole.token_ids


@pytest.mark.parametrize(("structured", "reason"), [
    ({"json": {"type": "strnig"}}, "strnig"),
    ({"json": {"type": "object", "not": {"required": ["a"]}}}, "not"),
    ({"regex": "(unclosed"}, ""),
    ({"grammar": "root ::= missing_rule"}, "missing_rule"),
    ({"choice": []}, "choice"),
])
def test_bad_grammar_is_refused_with_its_reason(default_engine, structured, reason):
    with pytest.raises(InvalidRequestError) as info:
        default_engine.generate(["x"], SamplingParams(max_tokens=4, structured_output=structured))
    assert info.value.param == "structured_output"
    assert reason in str(info.value)


def test_thousands_of_choices(default_engine):
    # Past 2,000 choices llguidance's own choice rule gave up after the first token, and the output was empty.
    choices = [f"item {i}" for i in range(5000)]
    [result] = _run(default_engine, ["Pick an item."], {"choice": choices}, max_tokens=8)
    assert result.text in choices and result.finish_reason == "stop"


def test_a_grammar_the_engine_gives_up_on_fails_its_request_alone(default_engine):
    # A rule of 2,500 alternatives passes compilation; llguidance's parser meets its limit of 2,000 items a row
    # once the rule is reached. That request fails naming the processor; the one beside it runs on.
    grammar = 'start: "Answer: " word\nword: ' + " | ".join(f'"w{i}"' for i in range(2500))
    given_up, plain = default_engine.generate(
        ["Say a word.", "Say a word."],
        # The plain one ignores EOS: sampled at temperature 1, it could end early by chance, which is not at issue.
        [SamplingParams(max_tokens=8, structured_output={"grammar": grammar}),
         SamplingParams(max_tokens=8, ignore_eos=True)])
    assert given_up.finish_reason == "error" and given_up.error.plugin == "structured_output"
    assert "max is 2000" in given_up.error.message
    assert plain.finish_reason == "length" and plain.error is None


@pytest.mark.parametrize("method", ["ngram", "layer-skip"])
def test_speculation_keeps_the_grammar_and_the_tokens(registry, default_source, default_engine, method):
    # Where the grammar forces nothing the method guesses (layer-skip writes the target's cache at its positions).
    engine = LLM(EngineConfig(speculative=SpeculativeConfig(method=method, num_speculative_tokens=4)),
                 registry=registry, source=default_source)
    prompts = [_chat(engine, "Repeat this JSON: {\"name\": \"Bob\", \"age\": 30, \"role\": \"user\"}"), PROMPTS[0]]
    params = SamplingParams(max_tokens=60, temperature=0.0, structured_output={"json": PERSON})
    fast, slow = engine.generate(prompts, params), default_engine.generate(prompts, params)
    assert [r.token_ids for r in fast] == [r.token_ids for r in slow]
    for result in fast:
        jsonschema.validate(json.loads(result.text), PERSON)


def test_forced_tokens_are_verified_in_one_step_and_change_no_token(registry, default_source, default_engine):
    # On a CPU the engine proposes what a grammar forces (a key, its quotes and colon) by default; an engine that
    # proposes nothing gives the very same tokens, one step each.
    plain = LLM(EngineConfig(speculative=SpeculativeConfig(grammar_proposals=False)), registry=registry,
                source=default_source)
    prompts = [_chat(default_engine, p) for p in (*PROMPTS[:2], "Answer in JSON.", "Pick a colour.", "Write a sum.")]
    params = [SamplingParams(max_tokens=60, temperature=0.0, structured_output={"json": PERSON})] * 2 + [
        SamplingParams(max_tokens=30, temperature=0.0, structured_output={"json_object": True}),
        SamplingParams(max_tokens=8, temperature=0.0, structured_output={"choice": ["light blue", "dark red"]}),
        SamplingParams(max_tokens=12, temperature=0.0,
                       structured_output={"grammar": 'root ::= "sum: " num " + " num\nnum ::= [1-9] [0-9]?'})]
    stats = default_engine.core.speculator.stats[GRAMMAR]
    before = (stats.num_proposed_tokens, stats.num_accepted_tokens)
    forced = default_engine.generate(prompts, params)
    assert [r.token_ids for r in forced] == [r.token_ids for r in plain.generate(prompts, params)]
    proposed, accepted = stats.num_proposed_tokens - before[0], stats.num_accepted_tokens - before[1]
    # PERSON's keys alone are forced: "name", "age" and "role" in each of the two objects.
    assert accepted >= 12 and proposed >= accepted
    assert GRAMMAR not in plain.core.speculator.stats
    for result in forced[:2]:
        jsonschema.validate(json.loads(result.text), PERSON)
    assert forced[3].text in ("light blue", "dark red") and forced[4].text.startswith("sum: ")


def test_overlapped_steps_give_the_serial_tokens(registry, default_source, default_engine):
    # Asynchronous scheduling (the GPU default): a grammar's mask is filled after the previous step's tokens are
    # read, while the next forward pass runs. Requests end at different steps (a choice after a token or two).
    overlapped = LLM(EngineConfig(async_scheduling=True), registry=registry, source=default_source)
    prompts = [_chat(default_engine, p) for p in (*PROMPTS[:2], "Is it raining?", "Count to five.")]
    params = [SamplingParams(max_tokens=48, temperature=0.0, structured_output={"json": PERSON}),
              SamplingParams(max_tokens=48, temperature=0.0, structured_output={"regex": "[a-z ]{3,30}"}),
              SamplingParams(max_tokens=8, temperature=0.0, structured_output={"choice": ["yes", "no"]}),
              SamplingParams(max_tokens=24, temperature=0.0, logit_bias={13: -100})]
    serial = default_engine.generate(prompts, params)
    assert [r.token_ids for r in overlapped.generate(prompts, params)] == [r.token_ids for r in serial]
    jsonschema.validate(json.loads(serial[0].text), PERSON)
    assert serial[2].text in ("yes", "no")


def test_preempted_guided_requests_recompute_to_the_same_tokens(registry, default_source, default_engine):
    # A KV cache that holds about two of these at full length: the others are preempted and recomputed, and the
    # grammar state of each is rebuilt from its tokens (never advanced twice over the recomputed ones).
    tight = LLM(EngineConfig(num_kv_blocks=12, enable_prefix_caching=False), registry=registry, source=default_source)
    prompts = [_chat(default_engine, p) for p in (*PROMPTS[:3], "Name a colour.")]
    params = [SamplingParams(max_tokens=40, temperature=0.0, structured_output={"json": PERSON})] * 3 + \
             [SamplingParams(max_tokens=40, temperature=0.0, structured_output={"regex": "[a-z ]{3,60}"})]
    expected = [r.token_ids for r in default_engine.generate(prompts, params)]
    ids = [tight.add_request(p, sp) for p, sp in zip(prompts, params)]
    tokens: dict[str, list[int]] = {i: [] for i in ids}
    preempted = set()
    while tight.has_unfinished_requests():
        for out in tight.step():
            tokens[out.req_id] += out.new_token_ids
        preempted |= {r.req_id for r in tight.core.requests.values() if r.num_preemptions}
    assert preempted, "a cache of 12 blocks must force preemption"
    assert [tokens[i] for i in ids] == expected
