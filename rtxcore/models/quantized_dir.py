"""A quantized checkpoint written by ``rtx quantize``: a Hugging Face directory whose linear weights are stored in
their quantizers' forms (see :mod:`rtxcore.quant.checkpoint`)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterator

import torch

from rtxcore.contracts.quantizer import QuantizedTensor
from rtxcore.errors import ModelLoadError
from rtxcore.models.hf_dir import HFDirSource
from rtxcore.models.source import Progress
from rtxcore.quant.checkpoint import read_weights, rtx_section


class QuantizedDirSource(HFDirSource):
    @staticmethod
    def matches(path: Path) -> bool:
        if not HFDirSource.matches(path):
            return False
        try:
            return rtx_section(json.loads((path / "config.json").read_text())) is not None
        except (OSError, ValueError):
            return False  # HFDirSource reports the unreadable config

    def __init__(self, path: Path, name: str | None = None):
        super().__init__(path, name)
        section = rtx_section(json.loads((path / "config.json").read_text()))
        if section is None:  # resolve_model asks matches() first; a direct caller may not have
            raise ModelLoadError(f"{path}/config.json: no quantization_config.rtx section: not a quantized checkpoint")
        self._section = section

    def quantization_methods(self) -> tuple[str, ...]:
        layers = self._section.get("layers") or {}
        methods: dict[str, None] = {}  # only the keys matter: a set that keeps order
        for name, info in layers.items():
            method = info.get("method") if isinstance(info, dict) else None
            if not isinstance(method, str):
                raise ModelLoadError(f"{self.path}/config.json: layer {name}: malformed entry (no method)")
            methods[method] = None
        return tuple(sorted(methods))

    def weights(self, progress: Progress | None = None, device: str | torch.device = "cpu",
                dtype: torch.dtype = torch.float32) -> Iterator[tuple[str, torch.Tensor | QuantizedTensor]]:
        total = self.num_weights()
        for done, item in enumerate(read_weights(Path(self.path), self._section), 1):
            yield item
            if progress:
                progress(min(done, total), total)
