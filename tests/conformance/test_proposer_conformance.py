"""The proposer contract: every built-in proposer passes it, with proposals to verify (the greedy comparison is not
vacuous), and deliberately wrong proposers are each caught naming the rule they break."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest

from rtx_conformance.plugin import Selection
from rtx_conformance.report import render_table, summarize
from rtx_conformance.runner import run_suite
from rtx_plugins.proposers.layer_skip import LayerSkipProposer
from rtx_plugins.proposers.ngram import NgramProposer
from rtxcore.hookspecs import hookimpl
from rtxcore.registry import load_plugins

BUILTINS = ("assisted", "draft", "layer-skip", "ngram")


class TooLongProposer(NgramProposer):
    """Pads every proposal to one token past what was asked for."""

    def propose(self, reqs, num_tokens):
        return [[5] * (k + 1) for k in num_tokens]


class NumpyProposer(NgramProposer):
    """Returns numpy integers, which the engine would take for no proposal at all."""

    def propose(self, reqs, num_tokens):
        return [list(np.full(k, 5, dtype=np.int64)) for k in num_tokens]


class MutatingProposer(NgramProposer):
    """Leaves its guesses in the request itself."""

    def propose(self, reqs, num_tokens):
        proposals = super().propose(reqs, num_tokens)
        for req in reqs:
            req.spec_token_ids = [5]
        return proposals


class StrictFinishProposer(NgramProposer):
    """Keeps per-request state and fails to forget a request it never saw."""

    def __init__(self, context):
        super().__init__(context)
        self.seen: set[str] = set()

    def propose(self, reqs, num_tokens):
        self.seen.update(req.req_id for req in reqs)
        return super().propose(reqs, num_tokens)

    def finish(self, req):
        self.seen.remove(req.req_id)


class OffByOneLayerSkip(LayerSkipProposer):
    """Drafts from the right token at the wrong position: one back, which overwrites the target's KV of a token it
    has already computed."""

    def propose(self, reqs, num_tokens):
        shifted = [dataclasses.replace(req, all_token_ids=req.all_token_ids[:-2] + req.all_token_ids[-1:])
                   for req in reqs]
        return super().propose(shifted, num_tokens)


class LogProbLayerSkip(LayerSkipProposer):
    """Gives log-probabilities for confidences."""

    def confidences(self, req):
        confidences = super().confidences(req)
        return None if confidences is None else [math.log(p) for p in confidences]


class WrongProposers:
    @hookimpl
    def register_proposers(self, register):
        register("too-long", TooLongProposer)
        register("numpy-ints", NumpyProposer)
        register("mutating", MutatingProposer)
        register("strict-finish", StrictFinishProposer)
        register("off-by-one", OffByOneLayerSkip)
        register("logprob-confidences", LogProbLayerSkip)


@pytest.fixture(scope="module")
def proposer_run():
    registry = load_plugins(extra=[("wrong-proposers", WrongProposers())])
    return run_suite(registry, Selection(kinds=("proposer",)))


def _results(run, name: str):
    return [r for r in run.session.results if (r.kind, r.name) == ("proposer", name)]


@pytest.mark.parametrize("name", BUILTINS)
def test_builtin_proposer_passes(proposer_run, name):
    results = _results(proposer_run, name)
    assert {r.check for r in results} == {"propose", "finish", "greedy_unchanged"}
    assert all(r.outcome == "passed" for r in results), [(r.check, r.message) for r in results]
    # Proposals were verified, some accepted: speculation really ran next to plain decoding.
    greedy = next(r for r in results if r.check == "greedy_unchanged")
    assert greedy.figures["proposed"] > 0 and greedy.figures["acceptance_rate"] > 0, greedy.figures


@pytest.mark.parametrize("name, rule, detail", [
    ("too-long", "[proposer.output_shape]", "where at most 1 were asked for"),
    ("numpy-ints", "[proposer.output_shape]", "(int64) is not an int"),
    ("mutating", "[proposer.request_unchanged]", "spec_token_ids [] -> [5]"),
    ("strict-finish", "[proposer.finish]", "raised KeyError"),
    ("off-by-one", "[proposer.greedy_unchanged]", "without speculation"),
    ("logprob-confidences", "[proposer.confidences]", "is not a probability"),
])
def test_wrong_proposer_is_caught_naming_the_rule(proposer_run, name, rule, detail):
    failures = [r.message for r in _results(proposer_run, name) if r.outcome == "failed"]
    assert any(rule in m and detail in m for m in failures), failures


def test_the_table_says_why(proposer_run):
    assert not proposer_run.passed
    table = render_table(summarize(proposer_run.session))
    assert "FAILED proposer off-by-one: [proposer.greedy_unchanged]" in table
    for name in BUILTINS:
        row = next(line for line in table.splitlines() if line.startswith(f"{name} "))
        assert "proposer" in row and "pass (7/7 rules)" in row, row
