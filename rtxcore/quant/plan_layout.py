"""A mixed-precision plan laid over another model of the same architecture, by relative depth.

``rtx quantize --plan`` chooses formats on a model with real weights and text. A plan's speed at a size that has no
weights to plan on (``dummy:llama-8b`` on the H200: ``benchmarks/quant_speed.py --plan DIR``) is measured by giving
each decoder layer of the larger model the formats of the planned model's layer at the same relative depth (layer
``j`` of ``m`` takes layer ``j * n // m`` of ``n``), projection by projection; what the plan left in float stays float.
This carries over the plan's mix of formats and where in depth it put them, not a plan for the other model's weights.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from rtxcore.contracts.quantizer import QuantizedTensor, Quantizer
from rtxcore.errors import ConfigError
from rtxcore.models.source import DerivedSource, ModelSource, Progress

_DECODER_WEIGHT = re.compile(r"model\.layers\.(\d+)\.(.+)")


@dataclass(frozen=True, slots=True)
class PlanLayout:
    """Which method each planned decoder weight has: (layer index, the rest of its name) -> method."""

    num_layers: int
    methods: dict[tuple[int, str], str]
    # The method the plan was asked for (``rtx quantize --method``), for labels.
    method: str = ""

    def method_for(self, name: str, num_layers: int) -> str | None:
        """The method the plan gives weight ``name`` of a model with ``num_layers`` layers; None: float."""
        match = _DECODER_WEIGHT.fullmatch(name)
        if match is None:
            return None
        return self.methods.get((int(match.group(1)) * self.num_layers // num_layers, match.group(2)))

    def counts(self, names: list[str], num_layers: int) -> dict[str, int]:
        """Weights per format among those of ``names`` (a model with ``num_layers`` layers) that the plan could
        quantize (the projections it names in some layer); ``float`` for those it left unquantized."""
        planned = {rest for _, rest in self.methods}
        return dict(Counter(self.method_for(n, num_layers) or "float" for n in names
                            if (m := _DECODER_WEIGHT.fullmatch(n)) is not None and m.group(2) in planned))


def read_plan(path: str | Path) -> PlanLayout:
    """The layout of the checkpoint ``rtx quantize`` wrote at ``path`` (its directory or its ``config.json``)."""
    file = Path(path)
    if file.is_dir():
        file = file / "config.json"
    try:
        config = json.loads(file.read_text())
    except OSError as exc:
        raise ConfigError(f"plan {path}: cannot read {file.name} ({exc.strerror})") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ConfigError(f"plan {path}: {file.name} is not JSON ({exc})") from None
    layers = (config.get("quantization_config") or {}).get("rtx", {}).get("layers") if isinstance(config, dict) \
        else None
    num_layers = config.get("num_hidden_layers") if isinstance(config, dict) else None
    if not isinstance(layers, dict) or not isinstance(num_layers, int) or num_layers < 1:
        raise ConfigError(f"plan {path}: {file.name} is not the config of a checkpoint `rtx quantize` wrote "
                          "(no quantization_config.rtx.layers or num_hidden_layers)")
    methods = {}
    for name, layer in layers.items():
        match = _DECODER_WEIGHT.fullmatch(name)
        if match is None or not isinstance(layer, dict) or not isinstance(layer.get("method"), str):
            raise ConfigError(f"plan {path}: layer {name!r} is not a decoder weight with a method")
        methods[(int(match.group(1)), match.group(2))] = layer["method"]
    method = config["quantization_config"]["rtx"].get("method")
    return PlanLayout(num_layers, methods, method if isinstance(method, str) else "")


class LaidOutSource(DerivedSource):
    """Another source's weights in a plan's formats: each planned decoder weight is quantized as it is yielded, by
    plain rounding (as ``--quantization`` does; it runs at the speed of a calibrated checkpoint of that format)."""

    def __init__(self, base: ModelSource, layout: PlanLayout, quantizer_for: Callable[[str], Quantizer]):
        super().__init__(base)
        self.layout, self._quantizer_for = layout, quantizer_for

    def num_weights(self) -> int:
        return self.base.num_weights()

    def quantization_methods(self) -> tuple[str, ...]:
        return tuple(sorted(set(self.layout.methods.values())))

    def weights(self, progress: Progress | None = None, device: str | torch.device = "cpu",
                dtype: torch.dtype = torch.float32) -> Iterator[tuple[str, torch.Tensor | QuantizedTensor]]:
        num_layers = self.config.num_layers
        for name, tensor in self.base.weights(progress, device, dtype):
            method = self.layout.method_for(name, num_layers)
            if method is not None and isinstance(tensor, torch.Tensor):
                yield name, self._quantizer_for(method).quantize(tensor)
            else:
                yield name, tensor
