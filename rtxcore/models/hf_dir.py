"""A Hugging Face model directory: config.json, *.safetensors and tokenizer files."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Iterator

import torch

from rtxcore.errors import ModelLoadError
from rtxcore.models.config import ModelConfig
from rtxcore.models.source import ModelSource, Progress

if TYPE_CHECKING:
    from rtxcore.contracts.quantizer import QuantizedTensor

SUPPORTED_ARCHITECTURES = {"LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM"}


class HFDirSource(ModelSource):
    @staticmethod
    def matches(path: Path) -> bool:
        return path.is_dir() and (path / "config.json").is_file()

    def __init__(self, path: Path, name: str | None = None):
        self.path = str(path)
        self.name = name or path.name
        try:
            raw = json.loads((path / "config.json").read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise ModelLoadError(f"{path / 'config.json'}: unreadable config ({exc})") from None
        archs = set(raw.get("architectures") or [])
        if archs and not archs & SUPPORTED_ARCHITECTURES:
            raise ModelLoadError(f"{path}: unsupported architecture {sorted(archs)}; supported: "
                                 f"{', '.join(sorted(SUPPORTED_ARCHITECTURES))}")
        self._config = ModelConfig.from_hf(raw, name=self.name)
        self._files = sorted(path.glob("*.safetensors"))
        if not self._files:
            raise ModelLoadError(f"{path}: no *.safetensors weight files")

    @property
    def config(self) -> ModelConfig:
        return self._config

    def tokenizer(self):
        from rtxcore.tokenizer import Tokenizer

        if not (Path(self.path) / "tokenizer.json").is_file():
            return None
        return Tokenizer.from_hf_dir(Path(self.path))

    def num_weights(self) -> int:
        from safetensors import SafetensorError, safe_open

        total = 0
        for f in self._files:
            try:
                with safe_open(str(f), framework="pt") as handle:
                    total += len(list(handle.keys()))
            except SafetensorError as exc:
                raise ModelLoadError(f"{f}: corrupt safetensors file ({exc})") from None
        return total

    def weights(self, progress: Progress | None = None, device: str | torch.device = "cpu",
                dtype: torch.dtype = torch.float32) -> Iterator[tuple[str, torch.Tensor | QuantizedTensor]]:
        from safetensors import SafetensorError, safe_open

        total = self.num_weights()
        done = 0
        for f in self._files:
            try:
                with safe_open(str(f), framework="pt") as handle:
                    for key in handle.keys():
                        yield key, handle.get_tensor(key)
                        done += 1
                        if progress:
                            progress(done, total)
            except SafetensorError as exc:
                raise ModelLoadError(f"{f}: corrupt safetensors file ({exc})") from None
