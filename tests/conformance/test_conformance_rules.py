"""What a broken plugin is told: the report counts rules, every failure starts with the rule's name (exceptions and
wrong return types included), a sampler that ignores its parameters fails unless it declares greedy_only, and a
plugin that fails to load fails the run, named in the table, the JSON and the JUnit report."""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET

import pytest
import torch

from rtx_conformance.plugin import Selection
from rtx_conformance.report import OUTCOMES, render_table, summarize, to_json
from rtx_conformance.rules import RULES, rules_of
from rtx_conformance.runner import run_suite
from rtx_plugins.eviction.lru import LRUPolicy
from rtxcore.cli.plugins import component_rows, table
from rtxcore.contracts import Sampler, SamplerOutput
from rtxcore.hookspecs import hookimpl
from rtxcore.registry import KINDS, load_plugins


class ArgmaxSampler(Sampler):
    """Ignores temperature, the filters and the seed: always the argmax."""

    def sample(self, logits, batch):
        return SamplerOutput(logits.argmax(dim=-1), torch.log_softmax(logits.float(), dim=-1).max(dim=-1).values)

    def target_probs(self, logits, batch):
        # An honest one-hot: a truncation of the standard distribution to its argmax.
        return torch.nn.functional.one_hot(logits.argmax(dim=-1), logits.shape[-1]).float()


class GreedyOnlySampler(ArgmaxSampler):
    greedy_only = True


class StrEvictingPolicy(LRUPolicy):
    def evict(self):
        victim = super().evict()
        return None if victim is None else str(victim)


class RemoveIgnoringPolicy(LRUPolicy):
    def remove(self, block_id):
        pass


class RaisingPolicy(LRUPolicy):
    def touch(self, block_id):
        raise KeyError(block_id)


class UnbuildablePolicy(LRUPolicy):
    def __init__(self, capacity):
        raise RuntimeError("no config file")


class Broken:
    @hookimpl
    def register_samplers(self, register):
        register("argmax", ArgmaxSampler)
        register("greedy-only", GreedyOnlySampler)

    @hookimpl
    def register_eviction_policies(self, register):
        register("str-evicting", StrEvictingPolicy)
        register("remove-ignoring", RemoveIgnoringPolicy)
        register("raising", RaisingPolicy)
        register("unbuildable", UnbuildablePolicy)


class FailsToRegister:
    @hookimpl
    def register_schedulers(self, register):
        raise ImportError("no module named 'fancy_dependency'")


@pytest.fixture(scope="module")
def broken_run(tmp_path_factory):
    registry = load_plugins(load_entrypoints=False, extra=[("broken", Broken()), ("fails-to-register",
                                                                                   FailsToRegister())])
    junit = tmp_path_factory.mktemp("junit") / "report.xml"
    return run_suite(registry, Selection(), junit_path=junit), junit


def _summary(run, name):
    return next(s for s in summarize(run.session) if s.name == name)


@pytest.mark.parametrize("name, rule, detail", [
    ("argmax", "sampler.temperature", "at T=0.5"),
    ("argmax", "sampler.filters", "as many as without the filter"),
    ("argmax", "sampler.seed", "all drew token"),
    ("str-evicting", "eviction.api", "evict() returned '"),
    ("remove-ignoring", "eviction.tracks_candidates", "is still a candidate for the policy, but the pool took it "
                                                      "back with remove()"),
    ("raising", "eviction.api", "raised KeyError"),
    ("unbuildable", "eviction.builds", "UnbuildablePolicy(...) raised RuntimeError: no config file"),
])
def test_each_failure_starts_with_the_rule(broken_run, name, rule, detail):
    run, _ = broken_run
    failures = _summary(run, name).failures
    assert any(f.startswith(f"[{rule}] {RULES[rule]}: ") and detail in f for f in failures), failures


def test_an_exception_says_where_the_plugin_raised_it(broken_run):
    run, _ = broken_run
    failure = next(f for f in _summary(run, "raising").failures if f.startswith("[eviction.api]"))
    assert "test_conformance_rules.py:" in failure and "in touch)" in failure, failure


def test_greedy_only_declared_passes_with_the_draw_rules_skipped(broken_run):
    run, _ = broken_run
    summary = _summary(run, "greedy-only")
    assert summary.contract == "pass", summary.failures
    skipped = {r.rule for r in summary.rules if r.outcome == "skipped"}
    assert skipped == {"sampler.temperature", "sampler.filters", "sampler.seed", "sampler.distribution",
                       "sampler.target_is_truncation"}
    assert all("declares greedy_only" in r.message for r in summary.rules if r.outcome == "skipped")
    assert summary.contract_text == f"pass (7/{len(rules_of('sampler'))} rules, 5 skipped)"


def test_the_report_counts_rules_not_tests(broken_run):
    run, _ = broken_run
    argmax = _summary(run, "argmax")
    assert len(argmax.rules) == len(rules_of("sampler"))
    assert argmax.count("failed") >= 3 and sum(argmax.count(o) for o in OUTCOMES) == len(rules_of("sampler"))
    unbuildable = _summary(run, "unbuildable")
    # Nothing else could be checked: every other rule is not reached (not "skipped", which says a rule does not
    # apply), saying at which rule its checks stopped.
    assert unbuildable.count("failed") == 1 and unbuildable.count("passed") == unbuildable.count("skipped") == 0
    assert len(unbuildable.unreached) == len(rules_of("eviction_policy")) - 1
    assert all("stopped at eviction.builds first" in s for s in unbuildable.unreached), unbuildable.unreached
    assert unbuildable.contract_text == f"fail (0/{len(rules_of('eviction_policy'))} rules, 1 failed, " \
                                        f"{len(unbuildable.unreached)} not reached)"
    assert "NOT REACHED eviction_policy unbuildable: eviction.api: check" in render_table([unbuildable])
    # A policy whose method raised was built: its builds rule holds, not "not reached".
    raising = {r.rule: r.outcome for r in _summary(run, "raising").rules}
    assert raising["eviction.builds"] == "passed" and raising["eviction.api"] == "failed"


def test_a_plugin_that_fails_to_load_fails_the_run_in_every_report(broken_run):
    run, junit = broken_run
    assert not run.passed
    summaries = summarize(run.session)
    table = render_table(summaries)
    line = ("FAILED plugin fails-to-register (<inline>): [plugin.loads] " + RULES["plugin.loads"]
            + ": entry point 'fails-to-register' of <inline>: ImportError: no module named 'fancy_dependency'")
    assert line in table.splitlines(), table
    row = next(r for r in table.splitlines() if r.startswith("fails-to-register "))
    assert "fail (not loaded)" in row
    data = json.loads(to_json(run.session, summaries, False))
    component = next(c for c in data["components"] if c["name"] == "fails-to-register")
    assert component["loaded"] is False and component["failures"][0].startswith("[plugin.loads]")
    cases = {c.get("name"): c for c in ET.parse(junit).getroot().iter("testcase")}
    failure = cases["test_loads[plugin:fails-to-register]"].find("failure")
    assert failure is not None and failure.get("message").startswith("[plugin.loads]")


def test_every_rule_is_checked_by_some_test_of_its_kind(broken_run):
    run, _ = broken_run
    covered = {rule for r in run.session.results for rule in r.rules}
    expected = {rule for kind in ("sampler", "eviction_policy", "plugin") for rule in rules_of(kind)}
    assert expected <= covered, expected - covered
    assert set(RULES) == {rule for kind in [*KINDS, "plugin"] for rule in rules_of(kind)}


def test_rtx_plugins_list_shows_a_greedy_only_sampler():
    registry = load_plugins(load_entrypoints=False, extra=[("broken", Broken())])
    rows = {r["name"]: r for r in component_rows(registry)}
    assert rows["greedy-only"]["capabilities"] == {"greedy_only": True}
    assert "greedy_only" not in rows["argmax"]["capabilities"]
    line = next(line for line in table(list(rows.values())) if line.startswith("sampler") and " greedy-only " in line)
    assert line.endswith("available (greedy only: temperature, top-k, top-p, min-p and seed ignored)"), line
