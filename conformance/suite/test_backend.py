"""Backend contract: logits and greedy tokens against Hugging Face transformers on the same random weights."""

from __future__ import annotations

import pytest
import torch

from rtx_conformance.checks.backend import check_capabilities, run_against_reference
from rtxcore.models.dummy import DummySource

pytestmark = pytest.mark.rtx_kind("backend")


@pytest.fixture(scope="session")
def tiny_reference():
    pytest.importorskip("transformers", reason="the reference is Hugging Face transformers, which is not installed")
    from rtxcore.bench.hf_baseline import load_hf_model

    source = DummySource("tiny")
    return source, load_hf_model(source, "cpu", torch.float32)


@pytest.mark.rtx_rules("backend.capabilities")
def test_capabilities(component):
    check_capabilities(component.cls)


@pytest.mark.rtx_rules("backend.builds", "backend.logits_match", "backend.greedy_tokens")
def test_matches_reference(component, tiny_reference, record_figures):
    caps = check_capabilities(component.cls)
    if not caps.available:
        pytest.skip(f"backend unavailable here: {caps.unavailable_reason}")
    if "cpu" not in caps.devices or "float32" not in caps.dtypes:
        pytest.skip("the reference comparison runs in float32 on the CPU, which this backend does not offer")
    source, reference = tiny_reference
    run = run_against_reference(component.cls, source, reference)
    record_figures({"max_abs_logit_diff": run.max_abs_diff, "tolerance": run.tolerance,
                    "positions": run.num_positions})
