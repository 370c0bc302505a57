"""The logits-processor contract, checked on the processor itself and through a small engine.

A processor is tested with the arguments it declares as valid, ``describe()["example_args"]``. It is built as the
engine builds it, ``cls(LogitsProcessorContext(...))``, from the tiny random-weight model's context (``dummy:tiny``,
no tokenizer), or from the default model's where ``prepare()`` asks for a tokenizer. Then directly: ``prepare()``
takes every example and refuses wrong arguments with ``ValueError``; ``apply()`` changes its rows only, leaves each
row something to sample, does not advance a state, and scores a row after proposed tokens as a state that generated
them; the tokens ``forced_tokens()`` gives are ones ``apply()`` allows, one after another; states follow the
processor's own greedy choices through ``advance()``, rebuild from output tokens in ``new_state()`` and end in
``finish()``. Through the engine: greedy requests with each example complete, every output token allowed by the
processor.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from rtx_conformance.checks.logits_processor_harness import Harness, Models, call_checked, random_logits, short
from rtx_conformance.rules import ContractViolation, require
from rtxcore.contracts.logits_processor import RowContext
from rtxcore.sampling_params import SamplingParams

# Arguments no processor takes: prepare() must refuse each with ValueError (the engine answers only that as a 400).
WRONG_ARGS: tuple[Any, ...] = (object(), {"bogus": 1})
# Greedy steps a state takes by its processor's own choices.
NUM_WALK_STEPS = 6
# Output tokens of each request through the engine.
ENGINE_MAX_TOKENS = 8
# Most tokens forced_tokens() is asked for.
MAX_FORCED_ASKED = 8
# Prompts of the engine's requests: token ids for the tiny model (no tokenizer), text for the default model.
TINY_PROMPT = [5, 9, 13]
TEXT_PROMPT = "The answer is"


def check_prepare(h: Harness) -> None:
    """Every example was prepared in the harness; here, wrong arguments."""
    rule = "logits_processor.prepare"
    for args in WRONG_ARGS:
        try:
            got = h.processor.prepare(args)
        except ValueError:
            continue
        except Exception as exc:
            raise ContractViolation(rule, f"prepare({short(args)}) raised {type(exc).__name__}: {exc}; a wrong "
                                          f"argument must raise ValueError (the engine answers that as a 400, "
                                          f"anything else fails the request as a server error)") from exc
        raise ContractViolation(rule, f"prepare({short(args)}) returned {short(got)} instead of raising "
                                      f"ValueError")


def check_apply(h: Harness, seed: int = 0) -> None:
    """A fresh state per example, one row each, between two rows of no request: the batch changes its rows only,
    each as it would alone, and leaves each something to sample."""
    num = len(h.prepared)
    before = random_logits(num + 2, h.vocab_size, seed)
    logits = before.clone()
    rows = [RowContext(1 + i, h.new_state(i, rule="logits_processor.rows_only")) for i in range(num)]
    h.apply(logits, rows, "logits_processor.rows_only")
    rule = "logits_processor.rows_only"
    require(logits.shape == before.shape and logits.dtype == before.dtype, rule,
            f"the logits became {tuple(logits.shape)} {logits.dtype}, from {tuple(before.shape)} {before.dtype}")
    for other in (0, num + 1):
        require(torch.equal(logits[other], before[other]), rule,
                f"row {other}, not given to apply(), changed (rows given: {[r.row for r in rows]})")
    check_valid(logits, [r.row for r in rows], "apply() of a fresh state")
    for i in range(num):
        alone = h.scores(h.new_state(i, rule=rule), before[1 + i], rule)
        require(_same(logits[1 + i], alone), rule,
                f"example {i} ({short(h.examples[i])}): its row in a batch of {num} differs from the row alone")


def check_valid(logits: torch.Tensor, rows: Sequence[int], when: str) -> None:
    rule = "logits_processor.valid_logits"
    for row in rows:
        values = logits[row]
        require(not bool(torch.isnan(values).any()), rule, f"{when}: row {row} holds NaN")
        require(not bool(torch.isposinf(values).any()), rule, f"{when}: row {row} holds +inf")
        require(bool(torch.isfinite(values).any()), rule, f"{when}: row {row} has no finite logit left to sample")


def walk(h: Harness, states: Sequence[Any], seed: int, num_steps: int = NUM_WALK_STEPS) -> list[list[int]]:
    """Step ``states`` together (one row each) on random logits, each taking the argmax of its processed row and
    advancing over it, as a greedy request does; a state stops at an end-of-sequence token (the request would
    finish). :returns: each state's tokens, the end-of-sequence token left out."""
    tokens: list[list[int]] = [[] for _ in states]
    running = list(range(len(states)))
    for step in range(num_steps):
        if not running:
            break
        logits = random_logits(len(running), h.vocab_size, seed * 1000 + step)
        h.apply(logits, [RowContext(row, states[i]) for row, i in enumerate(running)], "logits_processor.advance")
        check_valid(logits, range(len(running)), f"step {step} of greedy decoding by the processor's own choices")
        chosen = logits.argmax(dim=1).tolist()
        still = []
        for i, token in zip(running, chosen):
            if token in h.eos_token_ids:
                continue
            h.advance(states[i], [token], "logits_processor.advance")
            tokens[i].append(token)
            still.append(i)
        running = still
    return tokens


def check_advance(h: Harness, seed: int = 1) -> list[list[int]]:
    """:returns: the tokens each example's state took."""
    return walk(h, [h.new_state(i, "logits_processor.advance") for i in range(len(h.prepared))], seed)


def check_apply_pure(h: Harness, seed: int = 2) -> None:
    """States fresh and advanced, batched: the same call twice gives the same logits."""
    rule = "logits_processor.apply_pure"
    num = len(h.prepared)
    fresh = [h.new_state(i, rule=rule) for i in range(num)]
    advanced = [h.new_state(i, rule=rule) for i in range(num)]
    walk(h, advanced, seed, num_steps=3)
    states = fresh + advanced
    before = random_logits(len(states), h.vocab_size, seed)
    rows = [RowContext(row, state) for row, state in enumerate(states)]
    first, second = before.clone(), before.clone()
    h.apply(first, rows, rule)
    h.apply(second, rows, rule)
    for row in range(len(states)):
        require(_same(first[row], second[row]), rule,
                f"example {row % num} ({short(h.examples[row % num])}, {'advanced' if row >= num else 'fresh'}): "
                f"a second apply() with the same state changed the row differently")


def check_proposed_rows(h: Harness, seed: int = 3) -> None:
    """Per example, the engine's rows under speculative decoding (one plain row, then one after each prefix of the
    processor's own tokens), in one call: each scores as a state advanced over its prefix, and the state is left as
    it was (a plain row after scores as a plain row before)."""
    rule = "logits_processor.proposed_rows"
    for i, tokens in enumerate(walk(h, [h.new_state(i, rule=rule) for i in range(len(h.prepared))], seed)):
        state = h.new_state(i, rule=rule)
        before = random_logits(1 + len(tokens), h.vocab_size, seed + i)
        plain_before = h.scores(state, before[0], rule)
        logits = before.clone()
        h.apply(logits, [RowContext(j, state, tokens[:j]) for j in range(1 + len(tokens))], rule)
        check_valid(logits, range(1 + len(tokens)), "apply() of rows after proposed tokens")
        for j in range(1, 1 + len(tokens)):
            reference = h.new_state(i, rule=rule)
            h.advance(reference, tokens[:j], rule)
            require(_same(logits[j], h.scores(reference, before[j], rule)), rule,
                    f"example {i} ({short(h.examples[i])}): the row after proposed {tokens[:j]} differs from a "
                    f"plain row of a state advanced over them")
        require(_same(h.scores(state, before[0], rule), plain_before), rule,
                f"example {i} ({short(h.examples[i])}): after rows with proposed tokens {tokens}, a plain row of "
                f"the state scores differently from before them")


def check_forced_tokens(h: Harness, seed: int = 7) -> None:
    """Along each example's own greedy tokens: forced_tokens() gives a list of at most the tokens asked for, each one
    that apply() allows after those before it, and leaves the state as it found it."""
    rule = "logits_processor.forced_tokens"
    for i, tokens in enumerate(walk(h, [h.new_state(i, rule) for i in range(len(h.prepared))], seed)):
        for k in range(1 + len(tokens)):
            state = h.new_state(i, rule, tokens[:k])
            logits = random_logits(1, h.vocab_size, seed + k)[0]
            before = h.scores(state, logits, rule)
            forced = call_checked(rule, "forced_tokens", h.processor.forced_tokens, state, MAX_FORCED_ASKED)
            where = f"example {i} ({short(h.examples[i])}) after {tokens[:k]}"
            require(isinstance(forced, list) and len(forced) <= MAX_FORCED_ASKED
                    and all(type(t) is int and 0 <= t < h.vocab_size for t in forced), rule,
                    f"{where}: forced_tokens(state, {MAX_FORCED_ASKED}) returned {short(forced)}, not a list of at "
                    f"most {MAX_FORCED_ASKED} token ids")
            require(_same(h.scores(state, logits, rule), before), rule,
                    f"{where}: forced_tokens() changed how the state scores")
            if not forced:
                continue
            rows = random_logits(len(forced), h.vocab_size, seed + k)
            h.apply(rows, [RowContext(j, state, forced[:j]) for j in range(len(forced))], rule)
            for j, token in enumerate(forced):
                require(bool(torch.isfinite(rows[j, token])), rule,
                        f"{where}: forced token {token} (number {j} of {forced}) is one apply() does not allow there")


def check_resume(h: Harness, seed: int = 4) -> None:
    """new_state(prepared, tokens) scores as a new state advanced over the tokens (a resumed request), for every
    prefix of the processor's own tokens."""
    rule = "logits_processor.resume"
    for i, tokens in enumerate(walk(h, [h.new_state(i, rule) for i in range(len(h.prepared))], seed)):
        logits = random_logits(1, h.vocab_size, seed + i)[0]
        for k in range(1, 1 + len(tokens)):
            got = h.scores(h.new_state(i, rule, tokens[:k]), logits, rule)
            check_valid(got.unsqueeze(0), [0], "apply() of a resumed state")
            advanced = h.new_state(i, rule)
            h.advance(advanced, tokens[:k], rule)
            require(_same(got, h.scores(advanced, logits, rule)), rule,
                    f"example {i} ({short(h.examples[i])}): new_state with output tokens {tokens[:k]} scores "
                    f"differently from a new state advanced over them")


def check_independent_states(h: Harness, seed: int = 5) -> None:
    """Two states from one prepared argument (two requests with the same arguments): advancing one leaves the
    other as new."""
    rule = "logits_processor.independent_states"
    for i in range(len(h.prepared)):
        waiting = h.new_state(i, rule=rule)
        logits = random_logits(1, h.vocab_size, seed + i)[0]
        fresh = h.scores(waiting, logits, rule)
        other = h.new_state(i, rule)
        tokens: list[int] = []
        for step in range(3):  # compared after each token: a state shared by mistake may come back to where it was
            [taken] = walk(h, [other], seed + 100 * i + step, num_steps=1)
            if not taken:
                break
            tokens += taken
            require(_same(h.scores(waiting, logits, rule), fresh), rule,
                    f"example {i} ({short(h.examples[i])}): another state from the same prepared argument advanced "
                    f"over {tokens}, and this one, never advanced, now scores differently")


def check_finish(h: Harness, seed: int = 6) -> None:
    """finish() of a state never applied, one applied, and one advanced."""
    rule = "logits_processor.finish"
    for i in range(len(h.prepared)):
        unused = h.new_state(i, rule=rule)
        applied = h.new_state(i, rule=rule)
        h.scores(applied, random_logits(1, h.vocab_size, seed)[0], rule)
        advanced = h.new_state(i, rule=rule)
        walk(h, [advanced], seed, num_steps=2)
        for what, state in (("never applied", unused), ("applied", applied), ("advanced", advanced)):
            call_checked(rule, f"finish() of a state {what}", h.processor.finish, state)


# -- through the engine ------------------------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class EngineRun:
    # Output tokens per example.
    outputs: list[list[int]]
    num_tokens: int


def check_engine(h: Harness, models: Models) -> EngineRun:
    """Each example in one greedy request: every request finishes, and each output token is one the processor
    allows at its place (replayed on a new state of the harness's processor: its logit stays finite)."""
    rule = "logits_processor.engine"
    try:
        engine = models.engine(h.tokenizer)
    except Exception as exc:  # every installed processor is built with the engine: another one may be at fault
        raise ContractViolation(rule, f"the engine could not be built: {type(exc).__name__}: {exc}") from exc
    prompt: str | list[int] = TEXT_PROMPT if h.tokenizer else TINY_PROMPT
    outputs = []
    for args in h.examples:
        params = SamplingParams(max_tokens=ENGINE_MAX_TOKENS, temperature=0.0,
                                logits_processors={h.record.name: args})
        try:
            [result] = engine.generate([prompt], params)
        except Exception as exc:
            for req_id in list(engine.core.requests):  # the engine is shared: leave it idle
                engine.abort(req_id)
            raise ContractViolation(rule, f"a request with {short(args)}: {type(exc).__name__}: {exc}") from exc
        require(result.finish_reason is not None and len(result.token_ids) > 0, rule,
                f"a request with {short(args)} ended without output or a finish reason "
                f"({result.token_ids}, {result.finish_reason!r})")
        outputs.append(list(result.token_ids))
    for i, tokens in enumerate(outputs):
        _check_allowed(h, i, tokens)
    return EngineRun(outputs, sum(len(t) for t in outputs))


def _check_allowed(h: Harness, index: int, tokens: Sequence[int]) -> None:
    rule = "logits_processor.engine"
    state = h.new_state(index, rule=rule)
    flat = torch.zeros(h.vocab_size)
    for position, token in enumerate(tokens):
        score = h.scores(state, flat, rule)[token]
        require(bool(torch.isfinite(score)), rule,
                f"a request with {short(h.examples[index])}: output token {position} ({token}) is one the "
                f"processor refuses there (outputs {list(tokens)})")
        if token not in h.eos_token_ids:
            h.advance(state, [token], rule)


# -- helpers ------------------------------------------------------------------------------------------------------

def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-identical but for NaN, which check_valid reports on its own."""
    return bool(torch.equal(a, b)) or bool(((a == b) | (torch.isnan(a) & torch.isnan(b))).all())
