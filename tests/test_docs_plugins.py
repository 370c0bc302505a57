"""docs/plugins.md documents every hook with its signature and every conformance rule."""

from __future__ import annotations

import inspect

from rtx_conformance.rules import RULES
from rtxcore import hookspecs
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
