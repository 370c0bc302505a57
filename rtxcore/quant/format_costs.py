"""What a linear layer costs to decode in each format at a model's shapes: the planner's measure of speed.

Decode at small batches runs every layer once a token on one row, so a format's cost at a shape is the time of one
row's product through the quantizer's own kernel (``Quantizer.linear``; ``torch.nn.functional.linear`` for the
float weights), measured on the device that will serve. ``rtx quantize --plan --format-costs FILE`` plans with a table
measured elsewhere (``benchmarks/format_costs.py`` on a GPU, then carried), ``--format-costs measure`` measures on
``--device`` first; without a table the planner counts weight bytes, which decode reads once a token.

On a GPU each product is timed as a CUDA graph of many replays (as the engine decodes), so the host's launch cost,
which the graph removes when serving, is not counted.
"""

from __future__ import annotations

import functools
import json
import statistics
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from rtxcore.contracts.quantizer import Quantizer
from rtxcore.errors import ConfigError
from rtxcore.models.config import ModelConfig

FLOAT = "bf16"
_CALLS = 50
_REPEATS = 5


def shape_key(shape: tuple[int, int]) -> str:
    return f"{shape[0]}x{shape[1]}"


@dataclass(slots=True)
class FormatCosts:
    """Seconds of one decode row's product per format (``bf16`` for float weights) and shape (``"NxK"``)."""

    device: str
    seconds: dict[str, dict[str, float]] = field(default_factory=dict)

    def cost(self, method: str | None, shape: tuple[int, int]) -> float:
        fmt = method or FLOAT
        value = self.seconds.get(fmt, {}).get(shape_key(shape))
        if value is None:
            raise ConfigError(f"the format cost table ({self.device}) has no {fmt} at {shape_key(shape)}: measure it "
                              f"for this model's shapes and formats")
        return value

    def to_json(self) -> dict[str, Any]:
        return {"device": self.device, "seconds": self.seconds}

    @classmethod
    def from_file(cls, path: Path) -> FormatCosts:
        try:
            data = json.loads(Path(path).read_text())
        except OSError as exc:
            raise ConfigError(f"--format-costs {path}: cannot read it ({exc.strerror})") from None
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ConfigError(f"--format-costs {path}: not JSON ({exc})") from None
        seconds = data.get("seconds") if isinstance(data, dict) else None
        if not isinstance(seconds, dict) or not all(
                isinstance(by_shape, dict) and all(isinstance(v, (int, float)) and v > 0 for v in by_shape.values())
                for by_shape in seconds.values()):
            raise ConfigError(f"--format-costs {path}: not a format cost table (a 'seconds' object of format -> "
                              "'NxK' -> positive seconds)")
        return cls(str(data.get("device", path)), {f: {k: float(v) for k, v in s.items()} for f, s in seconds.items()})


def decode_shapes(config: ModelConfig) -> list[tuple[int, int]]:
    """The shapes of a decoder layer's products as they run, fused: q|k|v, o, gate|up, down (out, in features)."""
    q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    h, i = config.hidden_size, config.intermediate_size
    return list(dict.fromkeys([(q + 2 * kv, h), (h, q), (2 * i, h), (h, i)]))


def measure(shapes: Iterable[tuple[int, int]], methods: Iterable[str], quantizer_for: Callable[[str], Quantizer],
            device: str | torch.device, dtype: torch.dtype = torch.bfloat16) -> FormatCosts:
    """Time one row's product at each shape for float weights and each method (random weights: the time does not
    depend on their values)."""
    device = torch.device(device)
    generator = torch.Generator(device="cpu").manual_seed(0)
    costs = FormatCosts(torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu")
    for shape in shapes:
        weight = (torch.randn(shape, generator=generator) * 0.02).to(device, dtype)
        x = torch.randn(1, shape[1], generator=generator).to(device, dtype)
        products: dict[str, Callable[[], torch.Tensor]] = {FLOAT: functools.partial(F.linear, x, weight)}
        for method in methods:
            quantizer = quantizer_for(method)
            products[method] = functools.partial(quantizer.linear, x, quantizer.quantize(weight))
        for fmt, product in products.items():
            costs.seconds.setdefault(fmt, {})[shape_key(shape)] = _time(product, device)
    return costs


def _time(product: Callable[[], torch.Tensor], device: torch.device) -> float:
    with torch.inference_mode():
        for _ in range(3):  # compile and autotune first
            product()
        if device.type != "cuda":
            runs = []
            for _ in range(_REPEATS):
                began = time.perf_counter()
                for _ in range(_CALLS):
                    product()
                runs.append((time.perf_counter() - began) / _CALLS)
            return statistics.median(runs)
        torch.cuda.synchronize(device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(_CALLS):
                product()
        graph.replay()
        torch.cuda.synchronize(device)
        runs = []
        for _ in range(_REPEATS):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            graph.replay()
            end.record()
            end.synchronize()
            runs.append(start.elapsed_time(end) / 1000 / _CALLS)
        return statistics.median(runs)
