"""Helpers shared by the tests of several packages (fixtures live in ``tests/conftest.py``)."""

from pathlib import Path

# The repository's root: docs, spec and chart files that tests read are found from here.
REPO = Path(__file__).resolve().parents[2]
