"""docs/plugins.md documents every hook with its signature, every conformance rule, and each kind's contract to the
signature as the code has it (the generated blocks)."""

from __future__ import annotations

import inspect

import pytest

from rtx_conformance.contract_docs import BEGIN, blocks, render_kind
from rtx_conformance.rules import RULES
from rtxcore import hookspecs
from rtxcore.registry import KINDS
from tests.helpers import REPO

DOC = (REPO / "docs" / "plugins.md").read_text()


def _hookspecs() -> list:
    return [f for _, f in inspect.getmembers(hookspecs, inspect.isfunction)
            if hasattr(f, f"{hookspecs.PROJECT_NAME}_spec")]


def test_every_hookspec_is_documented_with_its_signature():
    specs = _hookspecs()
    assert len(specs) >= 5
    for spec in specs:
        params = ", ".join(inspect.signature(spec).parameters)
        heading = f"### `{spec.__name__}({params})`"
        assert heading in DOC, f"docs/plugins.md lacks a section {heading}"
        section = DOC.split(heading, 1)[1].split("\n### ", 1)[0].split("\n## ", 1)[0]
        assert len(section.split()) >= 20, f"the section of {spec.__name__} says next to nothing"


def test_every_conformance_rule_is_documented():
    missing = [rule for rule in RULES if f"`{rule}`" not in DOC]
    assert not missing, f"docs/plugins.md lacks the rules {missing}"


@pytest.mark.parametrize("kind", list(KINDS))
def test_each_kind_is_documented_to_the_signature_as_the_code_says(kind):
    """The generated block of each kind (members, data types, rules, example) is what the contract renders to now."""
    block = blocks(DOC).get(kind)
    assert block is not None, f"docs/plugins.md lacks the generated block of {kind} ({BEGIN.format(kind=kind)})"
    assert block == render_kind(kind), (
        f"docs/plugins.md's {kind} block is out of date with the contract: run "
        "`python -m rtx_conformance.contract_docs docs/plugins.md`")


def test_the_generated_block_shows_signatures_and_required_methods():
    eviction = render_kind("eviction_policy")
    assert "| `__len__` | `__len__(self) -> int` | required |" in eviction
    assert "| `__contains__` | `__contains__(self, block_id: int) -> bool` | required |" in eviction
    sampler = render_kind("sampler")
    assert "| `token_ids` | `torch.Tensor` |" in sampler and "int64 [num_rows]" in sampler
    assert "`sampler.temperature`" in sampler and "rtx plugins new sampler my-sampler" in sampler


@pytest.mark.model
def test_the_guides_logits_processor_passes_the_suite_on_a_model_with_a_tokenizer():
    """The no-digits example, run as written: its prepare() refuses a context without a tokenizer, so the suite
    checks it on the default model, where it bans the digit tokens, rather than on dummy:tiny with nothing to ban."""
    import types

    from rtx_conformance.checks.logits_processor_harness import Models
    from rtx_conformance.plugin import Selection
    from rtx_conformance.runner import run_suite
    from rtxcore.registry import load_plugins

    source = DOC.split("```python\n# my_package/no_digits.py\n", 1)[1].split("```", 1)[0]
    module = types.ModuleType("my_package.no_digits")
    exec(compile(source, "docs/plugins.md (no_digits.py)", "exec"), module.__dict__)
    registry = load_plugins(extra=[("no-digits", module)])  # the built-ins too: the suite runs an engine
    run = run_suite(registry, Selection(names=("no-digits",)))
    results = [(r.check, r.outcome, r.message) for r in run.session.results if r.name == "no-digits"]
    assert run.passed and results, run.log
    # Checked where it has something to ban: the suite's harness takes the default model's context for it.
    models = Models(registry)
    record = registry.get("logits_processor", "no-digits")
    assert models.needs_tokenizer(record)
    assert len(record.cls(models.context(tokenizer=True)).digits) > 0
    assert all(outcome in ("passed", "skipped") for _, outcome, _ in results), results
    assert sum(outcome == "passed" for _, outcome, _ in results) >= 8, results
