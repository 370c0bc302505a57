"""What ``rtx quantize`` reports: the per-layer methods and errors, the fallbacks with their reasons, and the bytes
before and after, as the JSON written beside the checkpoint and as the table the command prints."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from rtxcore.contracts.quantizer import QuantizedTensor
from rtxcore.models.source import ModelSource
from rtxcore.quant.layer_errors import GroupChoice

if TYPE_CHECKING:
    from rtxcore.quant.pipeline import QuantizeOptions


def fallback_reason(choice: GroupChoice) -> str:
    if choice.reason is not None:
        return choice.reason
    steps = []
    for attempt in choice.attempts:
        over = attempt.over_budget
        if over:
            worst = max(over, key=lambda n: attempt.errors[n].relative)
            steps.append(f"{attempt.method} over budget ({short_name(worst)}: relative output error "
                         f"{attempt.errors[worst].relative:.4f} > {attempt.budget})")
    final = choice.method or "unquantized (checkpoint precision)"
    return "; ".join(steps) + f" -> {final}"


def short_name(name: str) -> str:
    return name.removeprefix("model.").removesuffix(".weight")


def _nbytes(value: torch.Tensor | QuantizedTensor) -> int:
    if isinstance(value, QuantizedTensor):
        return sum(t.numel() * t.element_size() for t in value.tensors.values())
    return value.numel() * value.element_size()


def build_report(source: ModelSource, options: QuantizeOptions, choices: list[GroupChoice], calibration_tokens: int,
                 tensors: dict) -> dict[str, Any]:
    layers, fallbacks = [], []
    for choice in choices:
        for name in choice.names:
            row: dict[str, Any] = {"name": name, "method": choice.method}
            if choice.method is not None:
                error = choice.errors[name]
                row.update(relative_error=round(error.relative, 6), snr_db=round(error.snr_db, 2),
                           budget=choice.attempts[-1].budget)
            layers.append(row)
        if choice.method != options.method:
            fallbacks.append({"layers": choice.names, "to": choice.method, "reason": fallback_reason(choice),
                              "attempts": [{"method": a.method, "budget": a.budget,
                                            "relative_errors": {n: round(e.relative, 6) for n, e in a.errors.items()},
                                            "over_budget": a.over_budget} for a in choice.attempts]})
    return {
        "model": source.name, "method": options.method,
        "max_layer_error": options.max_layer_error,
        "calibration": {"text": str(options.calibration_file) if options.calibration_file is not None
                        else "pydoc_data topics, second half", "tokens": calibration_tokens,
                        "chunk_len": options.chunk_len},
        "layers": layers, "fallbacks": fallbacks,
        "bytes": {"source_files": _source_bytes(source), "quantized": sum(_nbytes(t) for t in tensors.values())},
    }


def _source_bytes(source: ModelSource) -> int:
    path = Path(source.path)
    if path.is_file():
        return path.stat().st_size
    return sum(f.stat().st_size for f in path.glob("*.safetensors"))


def render_table(report: dict[str, Any]) -> str:
    """The per-layer table ``rtx quantize`` prints."""
    lines = [f"{'layer':<40} {'method':<10} {'rel. error':>10} {'SNR dB':>8}"]
    for row in report["layers"]:
        method = row["method"] or "float"
        error = f"{row['relative_error']:.4f}" if row["method"] else "-"
        snr = f"{row['snr_db']:.1f}" if row["method"] else "-"
        lines.append(f"{short_name(row['name']):<40} {method:<10} {error:>10} {snr:>8}")
    for fb in report["fallbacks"]:
        lines.append(f"fallback: {', '.join(short_name(n) for n in fb['layers'])}: {fb['reason']}")
    return "\n".join(lines)
