"""The logits-processor contract: every built-in processor passes it, so does a correct stateful one written here,
and deliberately wrong processors are each caught naming the rule they break."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest
import torch

from rtx_conformance.plugin import Selection
from rtx_conformance.report import render_table, summarize
from rtx_conformance.rules import rules_of
from rtx_conformance.runner import run_suite
from rtx_plugins.logits_processors.token_lists import AllowedTokens, BannedTokens
from rtxcore.contracts.logits_processor import LogitsProcessor, RowContext
from rtxcore.hookspecs import hookimpl
from rtxcore.registry import load_plugins

BUILTINS = ("logit_bias", "allowed_tokens", "banned_tokens", "min_tokens", "structured_output")
CHECKS = {"example_args", "builds", "prepare", "apply", "apply_pure", "proposed_rows", "forced_tokens", "advance",
          "resume", "independent_states", "finish", "engine"}


class Alternating(LogitsProcessor):
    """Arguments: two token ids; the request's tokens alternate between them, the first first. Correct."""

    stateful = True

    @classmethod
    def describe(cls) -> dict[str, Any]:
        return {"example_args": [[7, 11], [3, 3]]}

    def prepare(self, args: Any) -> tuple[int, int]:
        if not (isinstance(args, list) and len(args) == 2 and all(isinstance(t, int) for t in args)
                and all(0 <= t < self.context.vocab_size for t in args)):
            raise ValueError("give two token ids")
        return args[0], args[1]

    def new_state(self, prepared: tuple[int, int], output_token_ids: Sequence[int]) -> dict[str, Any]:
        return {"pair": prepared, "seen": len(output_token_ids)}

    def position(self, r: RowContext) -> int:
        return r.state["seen"] + len(r.proposed)

    def apply(self, logits: torch.Tensor, rows: Sequence[RowContext]) -> None:
        for r in rows:
            keep = r.state["pair"][self.position(r) % 2]
            value = logits[r.row, keep].clone()
            logits[r.row] = float("-inf")
            logits[r.row, keep] = value

    def forced_tokens(self, state: dict[str, Any], max_tokens: int) -> list[int]:
        # Every next token is forced.
        return [state["pair"][(state["seen"] + j) % 2] for j in range(max_tokens)]

    def advance(self, state: dict[str, Any], token_ids: Sequence[int]) -> None:
        state["seen"] += len(token_ids)


class NoExamples(AllowedTokens):
    @classmethod
    def describe(cls) -> dict[str, Any]:
        return {}


class TypeErrorOnWrongArgs(Alternating):
    def prepare(self, args: Any) -> tuple[int, int]:
        first, second = args  # a wrong argument raises whatever unpacking raises
        return first, second


class EveryRowBanned(BannedTokens):
    """Bans its tokens in every row of the batch, not only its own."""

    def apply(self, logits: torch.Tensor, rows: Sequence[RowContext]) -> None:
        logits[:, rows[0].state] = float("-inf")


class NothingLeft(AllowedTokens):
    """Forbids everything, the allowed tokens included."""

    def apply(self, logits: torch.Tensor, rows: Sequence[RowContext]) -> None:
        for r in rows:
            logits[r.row] = float("-inf")


class AdvancesInApply(Alternating):
    def apply(self, logits: torch.Tensor, rows: Sequence[RowContext]) -> None:
        super().apply(logits, rows)
        for r in rows:
            r.state["seen"] += 1


class IgnoresProposed(Alternating):
    def position(self, r: RowContext) -> int:
        return r.state["seen"]


class ForcesTheOther(Alternating):
    """Says the token after the next one is forced."""

    def forced_tokens(self, state: dict[str, Any], max_tokens: int) -> list[int]:
        return [state["pair"][(state["seen"] + 1) % 2]]


class ForgetsOutputs(Alternating):
    def new_state(self, prepared: tuple[int, int], output_token_ids: Sequence[int]) -> dict[str, Any]:
        return super().new_state(prepared, ())


class SharedState(Alternating):
    """Every request with the same arguments shares one state: the prepared one."""

    def prepare(self, args: Any) -> dict[str, Any]:
        return {"pair": super().prepare(args), "seen": 0}

    def new_state(self, prepared: dict[str, Any], output_token_ids: Sequence[int]) -> dict[str, Any]:
        prepared["seen"] = len(output_token_ids)
        return prepared


class StrictFinish(Alternating):
    """Forgets a state in finish() by a key only apply() sets."""

    def apply(self, logits: torch.Tensor, rows: Sequence[RowContext]) -> None:
        super().apply(logits, rows)
        for r in rows:
            r.state["applied"] = True

    def finish(self, state: dict[str, Any]) -> None:
        del state["applied"]


class TestProcessors:
    @hookimpl
    def register_logits_processors(self, register):
        register("alternating", Alternating)
        register("no-examples", NoExamples)
        register("type-error", TypeErrorOnWrongArgs)
        register("every-row", EveryRowBanned)
        register("nothing-left", NothingLeft)
        register("advances-in-apply", AdvancesInApply)
        register("ignores-proposed", IgnoresProposed)
        register("forces-the-other", ForcesTheOther)
        register("forgets-outputs", ForgetsOutputs)
        register("shared-state", SharedState)
        register("strict-finish", StrictFinish)


@pytest.fixture(scope="module")
def processor_run():
    registry = load_plugins(extra=[("test-processors", TestProcessors())])
    return run_suite(registry, Selection(kinds=("logits_processor",)))


def _results(run, name: str):
    return [r for r in run.session.results if (r.kind, r.name) == ("logits_processor", name)]


@pytest.mark.parametrize("name", [*BUILTINS, "alternating"])
def test_correct_processor_passes(processor_run, name):
    results = _results(processor_run, name)
    assert {r.check for r in results} == CHECKS
    assert all(r.outcome == "passed" for r in results), [(r.check, r.message) for r in results]
    engine = next(r for r in results if r.check == "engine")
    assert engine.figures["generated_tokens"] > 0, engine.figures


@pytest.mark.parametrize("name, rule, detail", [
    ("no-examples", "[logits_processor.example_args]", "describe() has no example_args"),
    ("type-error", "[logits_processor.prepare]", "raised TypeError"),
    ("every-row", "[logits_processor.rows_only]", "not given to apply(), changed"),
    ("nothing-left", "[logits_processor.valid_logits]", "no finite logit left"),
    ("advances-in-apply", "[logits_processor.apply_pure]", "a second apply() with the same state"),
    ("ignores-proposed", "[logits_processor.proposed_rows]", "the row after proposed"),
    ("forces-the-other", "[logits_processor.forced_tokens]", "is one apply() does not allow there"),
    ("forgets-outputs", "[logits_processor.resume]", "new_state with output tokens"),
    ("shared-state", "[logits_processor.independent_states]", "never advanced, now scores differently"),
    # What a processor raises is said with where it was raised.
    ("strict-finish", "[logits_processor.finish]", "never applied raised KeyError: 'applied' (at "
                                                   "conformance/test_logits_processor_conformance.py:"),
])
def test_wrong_processor_is_caught_naming_the_rule(processor_run, name, rule, detail):
    failures = [r.message for r in _results(processor_run, name) if r.outcome == "failed"]
    assert any(rule in m and detail in m for m in failures), failures


def test_the_table_says_why(processor_run):
    assert not processor_run.passed
    table = render_table(summarize(processor_run.session))
    assert "FAILED logits_processor every-row: [logits_processor.rows_only]" in table
    num_rules = len(rules_of("logits_processor"))
    for name in BUILTINS:
        row = next(line for line in table.splitlines() if line.startswith(f"{name} "))
        assert "logits_processor" in row and f"pass ({num_rules}/{num_rules} rules)" in row, row
