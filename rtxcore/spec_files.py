"""Where the spec files that code reads at run time are: ``gates.toml`` (the conformance gates) and ``openapi.yaml``
(``GET /openapi.json``), ``rtx.proto`` beside them.

They live in ``spec/`` at the top of the source tree and ship in the wheel as package data under ``rtxcore/spec/``
(``[tool.setuptools.package-dir]`` maps one onto the other). An installed wheel finds them there; an editable install
or a checkout finds the source tree's own, so an edit to ``spec/`` is seen at once.
"""

from __future__ import annotations

from pathlib import Path

_PACKAGE = Path(__file__).resolve().parent
# The wheel's copy first: in a checkout it does not exist, and the source tree's spec/ is one level up.
SPEC_DIRS = (_PACKAGE / "spec", _PACKAGE.parent / "spec")


def spec_path(name: str) -> Path:
    """The path of spec file ``name`` (``"gates.toml"``): the first of :data:`SPEC_DIRS` that holds it, else where
    the wheel would have it, so that a caller's "not found" names a real place."""
    for directory in SPEC_DIRS:
        path = directory / name
        if path.is_file():
            return path
    return SPEC_DIRS[0] / name
