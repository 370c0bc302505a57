"""The gates of spec/gates.toml: latency, cache and quality. Each runs for the kinds its section names, only with
``--gates``; one that cannot run on this machine is skipped with the reason, never passed."""

from __future__ import annotations

import importlib.util

import pytest

from rtx_conformance.gates.cache import run_cache
from rtx_conformance.gates.latency import device_name, run_latency, target_for
from rtx_conformance.gates.quality import (
    calibrate_reference,
    evaluation_tokens,
    load_reference,
    reference_perplexity,
    run_backend_quality,
    run_quantizer_quality,
)
from rtx_conformance.rules import build
from rtxcore.errors import ModelLoadError
from rtxcore.models.resolve import resolve_model


def _require_available(component) -> None:
    if component.kind == "backend":
        caps = component.cls.capabilities()
        if not caps.available:
            pytest.skip(f"backend unavailable here: {caps.unavailable_reason}")


@pytest.mark.rtx_gate("latency")
def test_gate_latency(component, conformance, record_figures):
    _require_available(component)
    gate = conformance.gates.latency
    device = device_name()
    target = target_for(gate, device)
    if target is None:
        pytest.skip(f"no latency target for this hardware ({device}) in the gates file")
    result = run_latency(gate, target, component, conformance.registry)
    record_figures({"hardware": result.hardware, "p50_itl_ms": round(result.p50_itl_ms, 1),
                    "p99_itl_ms": round(result.p99_itl_ms, 1), "target_ms": result.target_ms})
    assert result.passed, (f"p99 inter-token latency {result.p99_itl_ms:.1f} ms exceeds the {result.hardware} "
                           f"target of {result.target_ms} ms")


@pytest.mark.rtx_gate("cache")
def test_gate_cache(component, conformance, record_figures):
    result = run_cache(conformance.gates.cache, component, conformance.registry)
    record_figures({"hit_rate": round(result.hit_rate, 4), "tiered_hit_rate": round(result.tiered_hit_rate, 4),
                    "no_offload_hit_rate": round(result.no_offload_hit_rate, 4),
                    "min_hit_rate": result.min_hit_rate, "prompt_tokens": result.num_prompt_tokens})
    assert result.hit_rate >= result.min_hit_rate, (
        f"prefix-cache hit rate {result.hit_rate:.3f} is below {result.min_hit_rate}")
    assert result.tiered_hit_rate >= result.min_hit_rate, (
        f"prefix-cache hit rate with a small device cache and a host tier {result.tiered_hit_rate:.3f} is below "
        f"{result.min_hit_rate} (without the host tier: {result.no_offload_hit_rate:.3f})")


@pytest.fixture(scope="session")
def quality_reference(conformance):
    """(source, token ids, reference model, reference perplexity), loaded once per run."""
    if importlib.util.find_spec("transformers") is None:
        pytest.skip("the quality reference is Hugging Face transformers, which is not installed")
    try:
        source = resolve_model(None)
    except ModelLoadError as exc:
        pytest.skip(f"the default model is not installed: {exc}")
    token_ids = evaluation_tokens(source, conformance.gates.quality.num_tokens)
    model = load_reference(source)
    return source, token_ids, model, reference_perplexity(model, token_ids)


@pytest.fixture(scope="session")
def quality_calibration(conformance, quality_reference):
    """The reference model's layer statistics on calibration text; collected once per run, when a calibrated
    quantizer first needs them."""
    source, _, model, _ = quality_reference
    gate = conformance.gates.quality
    return calibrate_reference(model, source, gate.calibration_tokens, gate.calibration_chunk_len)


@pytest.mark.rtx_gate("quality")
def test_gate_quality(component, conformance, quality_reference, record_figures, request):
    _require_available(component)
    gate = conformance.gates.quality
    source, token_ids, model, reference_ppl = quality_reference
    if component.kind == "backend":
        result = run_backend_quality(gate, component.cls, source, token_ids, reference_ppl)
    else:
        quantizer = build("quantizer", component.cls)
        stats = request.getfixturevalue("quality_calibration") if quantizer.calibrated else None
        baseline = gate.quantizer_must_beat.get(component.name)
        result = run_quantizer_quality(gate, quantizer, component.name, model, token_ids, reference_ppl, stats,
                                       conformance.registry.create("quantizer", baseline) if baseline else None)
    figures = {"ppl": round(result.perplexity, 3), "reference_ppl": round(result.reference_perplexity, 3),
               "relative_change": round(result.relative_change, 5), "budget": result.budget, "bound": result.bound}
    if result.baseline_perplexity is not None:
        figures["baseline_ppl"] = round(result.baseline_perplexity, 3)
    record_figures(figures)
    assert result.change <= result.budget, (
        f"perplexity {result.perplexity:.3f} vs reference {result.reference_perplexity:.3f}: {result.bound} change "
        f"{result.change:+.4f} outside the budget {result.budget}")
    assert result.passed, (f"perplexity {result.perplexity:.3f} is not below its uncalibrated baseline's "
                           f"{result.baseline_perplexity:.3f} ({gate.quantizer_must_beat[component.name]})")

