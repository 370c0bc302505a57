"""What identifies a model's weights across processes: for caches kept on disk (exported graphs, KV snapshots)."""

from __future__ import annotations

import hashlib
from pathlib import Path

import torch

from rtxcore.models.source import ModelSource

_CHUNK = 8 << 20


def weights_fingerprint(source: ModelSource) -> str:
    """blake2b of the checkpoint's bytes: its files when it has any, else the tensors it yields (random weights)."""
    h = hashlib.blake2b(digest_size=20)
    if source.path:
        for path in _checkpoint_files(Path(source.path)):
            h.update(path.name.encode() + b"\0")
            with open(path, "rb") as fh:
                while chunk := fh.read(_CHUNK):
                    h.update(chunk)
    else:
        for name, tensor in source.weights():
            h.update(name.encode() + b"\0")
            # Only a checkpoint on disk (which has a path, hashed above) yields QuantizedTensor: random weights are
            # plain tensors.
            assert isinstance(tensor, torch.Tensor)
            h.update(tensor.contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _checkpoint_files(path: Path) -> list[Path]:
    if path.is_file():
        return [path]
    return sorted(p for p in path.iterdir() if p.is_file() and p.suffix in (".json", ".safetensors", ".gguf"))
