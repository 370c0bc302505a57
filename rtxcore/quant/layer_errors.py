"""How much a quantized layer changes its output on calibration inputs, and choosing each layer's method within an
error budget (falling back to higher precision where it is exceeded)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable

import torch

from rtxcore.contracts.quantizer import LayerStats, QuantizedTensor, Quantizer, check_stackable


@dataclass(frozen=True, slots=True)
class OutputError:
    # ||y - y_q|| / ||y|| over the sampled calibration rows, y = x W^T.
    relative: float
    # 10 log10(||y||^2 / ||y - y_q||^2), in dB.
    snr_db: float


def output_error(quantizer: Quantizer, weight: torch.Tensor, qt: QuantizedTensor, x: torch.Tensor) -> OutputError:
    """Measured through the quantizer's own ``linear`` (the path a backend runs, activation rounding included)."""
    x = x.to(weight.device, torch.float32)
    reference = x @ weight.float().t()
    diff = (reference - quantizer.linear(x, qt).float()).norm().item()
    signal = reference.norm().item()
    relative = diff / signal if signal > 0 else 0.0
    snr = math.inf if diff == 0 else 20 * math.log10(signal / diff) if signal > 0 else -math.inf
    return OutputError(relative, snr)


@dataclass(slots=True)
class Attempt:
    method: str
    budget: float
    errors: dict[str, OutputError]

    @property
    def over_budget(self) -> list[str]:
        return [name for name, e in self.errors.items() if not e.relative <= self.budget]


@dataclass(slots=True)
class GroupChoice:
    """The method chosen for layers that run fused (q|k|v, gate|up): they are quantized alike."""

    names: list[str]
    # None: kept at the checkpoint's precision.
    method: str | None
    qtensors: dict[str, QuantizedTensor]
    attempts: list[Attempt] = field(default_factory=list)
    # Why the group is not in the method asked for, when the planner (not a layer budget) decided it.
    reason: str | None = None

    @property
    def errors(self) -> dict[str, OutputError]:
        if self.method is None:
            return {}
        return next(a.errors for a in reversed(self.attempts) if a.method == self.method)


def choose(names: list[str], weights: dict[str, torch.Tensor], stats: dict[str, LayerStats], method: str,
           quantizer_for: Callable[[str], Quantizer], budget: float | None) -> GroupChoice:
    """Quantize the group with ``method``; while a member's output error is over budget, try the method's fallback,
    and in the end keep the group unquantized. ``budget`` None: ``method``'s own ``layer_error_budget``, kept along
    the fallbacks (the budget says what the layer may lose, whichever method meets it)."""
    attempts: list[Attempt] = []
    seen: set[str] = set()
    current: str | None = method
    limit = quantizer_for(method).layer_error_budget if budget is None else budget
    while current is not None and current not in seen:
        seen.add(current)
        quantizer = quantizer_for(current)
        # Only calibrated methods take statistics (older plugins' quantize() has no such parameter).
        qts = {n: quantizer.quantize(weights[n], stats[n]) if quantizer.calibrated else quantizer.quantize(weights[n])
               for n in names}
        check_stackable(list(qts.values()))  # the group runs fused: a ValueError now, not when the checkpoint loads
        errors = {n: output_error(quantizer, weights[n], qts[n], stats[n].sample) for n in names}
        attempts.append(Attempt(current, limit, errors))
        if not attempts[-1].over_budget:
            return GroupChoice(names, current, qts, attempts)
        current = quantizer.fallback
    return GroupChoice(names, None, {}, attempts)
