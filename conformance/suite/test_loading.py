"""Plugins that failed to load: each breaks rule plugin.loads, so the run fails and every report names it."""

from __future__ import annotations

import pytest

from rtx_conformance.rules import ContractViolation


@pytest.mark.rtx_rules("plugin.loads")
def test_loads(load_failure):
    raise ContractViolation("plugin.loads", f"entry point {load_failure.plugin!r} of {load_failure.package}: "
                                            f"{load_failure.error}")
