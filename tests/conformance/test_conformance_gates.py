"""Gates on real work: perplexity of the torch backend and of the built-in quantizers against transformers on the real
default model; a gate without a target for this hardware is skipped with the reason, never passed."""

from __future__ import annotations

from pathlib import Path

import pytest

from rtx_conformance.gates.config import DEFAULT_GATES_FILE
from rtx_conformance.plugin import Selection
from rtx_conformance.report import render_table, summarize
from rtx_conformance.runner import run_suite
from rtxcore.registry import load_plugins
from tests.helpers.conformance_plugins import WrongPlugins


@pytest.mark.model
@pytest.mark.hf
def test_quality_gate_for_backend_and_quantizers(tmp_path):
    registry = load_plugins(extra=[("wrong", WrongPlugins())])
    # Every built-in quantizer's quality (GPTQ beating plain rounding included) is `rtx gates`' quality gate, which
    # CI runs; here the suite's own path for one method, and a plugin that promises more than it keeps.
    names = ("torch", "int8", "int4-overpromising")
    run = run_suite(registry, Selection(names=names), gates=True, junit_path=tmp_path / "r.xml")
    summaries = {s.name: s for s in summarize(run.session)}
    torch_quality = summaries["torch"].gates["quality"]
    assert torch_quality.status == "pass", torch_quality
    # The same float32 weights through two implementations: perplexity agrees to far better than the budget.
    assert abs(torch_quality.figures["relative_change"]) < 1e-3
    reference = torch_quality.figures["reference_ppl"]
    assert 5 < reference < 40
    # Measured, with figures; its verdict depends on the machine's load (see test_conformance_cli).
    assert summaries["torch"].gates["latency"].figures["p99_itl_ms"] > 0
    int8 = summaries["int8"]
    assert int8.contract == "pass" and int8.gates["quality"].status == "pass", int8
    assert int8.gates["quality"].figures["bound"] == "absolute"
    # The bar: int8 within 0.5 perplexity of the float model.
    assert reference < int8.gates["quality"].figures["ppl"] <= reference + 0.5
    # Its contract fails (error bound); its quality gate measures what it costs, pass or fail, with figures.
    overpromising = summaries["int4-overpromising"]
    assert overpromising.contract == "fail" and overpromising.gates["quality"].figures["bound"] == "increase"
    assert overpromising.gates["quality"].figures["ppl"] > int8.gates["quality"].figures["ppl"]
    table = render_table(list(summaries.values()))
    assert "ppl=" in table and "reference_ppl=" in table


def test_gate_without_target_for_this_hardware_is_skipped(tmp_path):
    gates = tmp_path / "gates.toml"
    text = DEFAULT_GATES_FILE.read_text()
    gates.write_text(text.replace('device = "cpu"', 'device = "some-other-chip"'))
    run = run_suite(load_plugins(), Selection(names=("fcfs",)), gates=True, gates_file=Path(gates))
    latency = summarize(run.session)[0].gates["latency"]
    assert latency.status == "skipped" and "no latency target for this hardware (cpu)" in latency.reason
    assert run.passed  # skipped is neither pass nor fail: the run's verdict rests on what did run
    assert "skipped: no latency target" in render_table(summarize(run.session))
