"""What smoothing buys W8A8 int8 on the real default model: perplexity of ``int8-sq`` on the quality gate's text
with its smoothing (calibrated on the gate's calibration text) and without it (s = 1, plain per-token W8A8), beside
the float reference, all in one run on the CPU.

Usage: python benchmarks/smoothquant_quality.py
"""

from __future__ import annotations

import datetime

from rtx_conformance.gates.config import load_gates
from rtx_conformance.gates.quality import (calibrate_reference, evaluation_tokens, load_reference,
                                           quantized_perplexity, reference_perplexity)
from rtx_plugins.quantizers.int8_sq import Int8SmoothQuantizer
from rtxcore.cli.bench import machine_description
from rtxcore.models.source import resolve_model


def main() -> None:
    gate = load_gates().quality
    source = resolve_model(None)
    token_ids = evaluation_tokens(source, gate.num_tokens)
    model = load_reference(source)
    reference = reference_perplexity(model, token_ids)
    stats = calibrate_reference(model, source, gate.calibration_tokens, gate.calibration_chunk_len)
    quantizer = Int8SmoothQuantizer()
    rows = [("float reference", reference),
            ("int8-sq without smoothing (plain W8A8)", quantized_perplexity(quantizer, model, token_ids, None)),
            ("int8-sq", quantized_perplexity(quantizer, model, token_ids, stats))]
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    print(f"# python benchmarks/smoothquant_quality.py\n# {date} on {machine_description()}; {source.name}, "
          f"{len(token_ids)} evaluation tokens, {gate.calibration_tokens} calibration tokens")
    for name, ppl in rows:
        print(f"{name:40} perplexity {ppl:8.3f}  {ppl - reference:+.3f}")


if __name__ == "__main__":
    main()
