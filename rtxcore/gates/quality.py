"""The quality gate: each built-in quantizer's perplexity on the default model against the unquantized reference
(Hugging Face transformers on the same GGUF), held to ``[quality.quantizer_max_ppl_increase]`` of spec/gates.toml
(the conformance suite's quality gate, run for every built-in at once), and a calibrated method to beating its
uncalibrated baseline.

Then each method ``planned`` names as a user deploys it within the seed's budget: ``rtx quantize --method M --plan
--calibration-tokens N --eval-tokens T`` (rtxcore.quant.planner chooses each layer group's format so that the bound
of the increase on unseen text, from planning text, is within ``plan_ppl_delta``; N is ``plan_calibration_tokens``,
T ``plan_eval_tokens``), the written
checkpoint loaded back and scored on the held-out text against the float model, held to
``planned_max_ppl_increase``. That part needs no transformers."""

from __future__ import annotations

import contextlib
import gc
import importlib.util
import os
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from rtx_conformance.gates.config import QualityGate, load_gates
from rtx_conformance.gates.quality import (
    calibrate_reference,
    evaluation_tokens,
    load_reference,
    reference_perplexity,
    run_quantizer_quality,
)
from rtxcore.gates.outcome import Check, did_not_run, skipped
from rtxcore.gates.thresholds import require
from rtxcore.models.resolve import resolve_model
from rtxcore.quant.pipeline import Calibration, QuantizeOptions, quantize_model
from rtxcore.registry import PluginRegistry, load_plugins

GATE = "quality"


@dataclass(frozen=True, slots=True)
class QualitySettings:
    quantizers: list[str]
    # Methods quantized through the planner, each held to planned_max_ppl_increase on the held-out text.
    planned: list[str]
    plan_ppl_delta: float
    planned_max_ppl_increase: float
    plan_calibration_tokens: int
    # Held-out tokens a plan is scored on: more than the gate's num_tokens, whose 512 are too few to hold a 0.5 budget
    # steadily (fp8's increase on them was +0.38 on one CPU and +0.54 on another, 0.25-0.26 on both over 2,048).
    plan_eval_tokens: int

    def __post_init__(self) -> None:
        for key in ("plan_ppl_delta", "planned_max_ppl_increase"):
            require(getattr(self, key) > 0, key, "> 0", getattr(self, key))
        require(self.plan_calibration_tokens >= 1, "plan_calibration_tokens", ">= 1", self.plan_calibration_tokens)
        # As rtx quantize --eval-tokens: a perplexity needs a token before the one it predicts.
        require(self.plan_eval_tokens >= 2, "plan_eval_tokens", ">= 2", self.plan_eval_tokens)


def run(settings: QualitySettings, gates_file: Path | None, say) -> list[Check]:
    gate = load_gates(gates_file).quality
    registry = load_plugins()
    if importlib.util.find_spec("transformers") is None:
        checks = [skipped(GATE, "quantizers' perplexity increase", "the reference is Hugging Face transformers, "
                                                                    "which is not installed")]
    else:
        checks = _every_layer_checks(settings, gate, registry, say)
    gc.collect()  # the reference model and its statistics, before the planner loads models of its own
    calibrations: dict[tuple, Calibration] = {}  # the float model's, made once for the methods that share it
    for name in settings.planned:
        say(f"quality: {name} planned within +{settings.plan_ppl_delta}...")
        try:
            checks.append(_planned_check(settings, name, settings.plan_eval_tokens, registry, calibrations))
        except Exception as exc:  # one method's failure is its own failed check; the others' figures stand
            checks.append(did_not_run(GATE, f"{name} planned: ran to the end", exc))
    return checks


def _every_layer_checks(settings: QualitySettings, gate: QualityGate, registry: PluginRegistry, say) -> list[Check]:
    """Each method on every linear layer of the HF reference (the conformance suite's quality gate)."""
    source = resolve_model(None)
    token_ids = evaluation_tokens(source, gate.num_tokens)
    say(f"quality: the reference perplexity on {len(token_ids)} tokens...")
    with _quiet_tqdm():  # transformers' GGUF reader draws a progress bar of its own into the report
        model = load_reference(source)
    reference = reference_perplexity(model, token_ids)
    stats = None
    checks = []
    for name in settings.quantizers:
        quantizer = registry.create("quantizer", name)
        if quantizer.calibrated and stats is None:
            say(f"quality: calibrating on {gate.calibration_tokens} tokens...")
            stats = calibrate_reference(model, source, gate.calibration_tokens, gate.calibration_chunk_len)
        say(f"quality: {name}...")
        baseline = gate.quantizer_must_beat.get(name)
        result = run_quantizer_quality(gate, quantizer, name, model, token_ids, reference, stats,
                                       registry.create("quantizer", baseline) if baseline else None)
        detail = f"perplexity {result.perplexity:.3f} against {reference:.3f}"
        checks.append(Check(GATE, f"{name}: perplexity increase", result.change, result.budget, "<=", detail))
        if result.baseline_perplexity is not None:
            checks.append(Check(GATE, f"{name}: perplexity / {baseline}'s", result.perplexity /
                                result.baseline_perplexity, 1.0, "<=", f"{baseline}: {result.baseline_perplexity:.3f}"))
    return checks


def _planned_check(settings: QualitySettings, method: str, eval_tokens: int, registry: PluginRegistry,
                   calibrations: dict[tuple, Calibration]) -> Check:
    with tempfile.TemporaryDirectory(prefix="rtx-gate-plan-") as tmp:
        options = QuantizeOptions(method, Path(tmp) / "model", calibration_tokens=settings.plan_calibration_tokens,
                                  eval_tokens=eval_tokens, target_ppl_delta=settings.plan_ppl_delta)
        with _quiet_tqdm():
            report = quantize_model(None, options, registry, calibrations=calibrations)
    evaluation, plan = report["evaluation"], report["plan"]
    formats = ", ".join(f"{m} {n}" for m, n in sorted(plan["layers_by_format"].items()))
    detail = (f"held-out perplexity {evaluation['ppl_quantized']:.3f} against {evaluation['ppl_original']:.3f}; "
              f"planned to at most {plan['ppl_increase_bound']:+.3f} on unseen text at {plan['confidence']:.0%}; "
              f"layers: {formats}; predicted decode speed-up {plan['predicted_decode_speedup_vs_bf16']}x")
    return Check(GATE, f"{method} planned: perplexity increase", evaluation["ppl_increase"],
                 settings.planned_max_ppl_increase, "<=", detail)


@contextlib.contextmanager
def _quiet_tqdm() -> Iterator[None]:
    before = os.environ.get("TQDM_DISABLE")
    os.environ["TQDM_DISABLE"] = "1"
    try:
        yield
    finally:
        if before is None:
            del os.environ["TQDM_DISABLE"]
        else:
            os.environ["TQDM_DISABLE"] = before
