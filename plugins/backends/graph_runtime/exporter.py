"""Export the model to ONNX once per (weights, settings) and reuse the file on every later start.

The TorchScript exporter (``torch.onnx.export(dynamo=False)``) is used: on SmolLM2-135M (torch 2.13, 2 CPU cores)
it exported in 17 s against 126 s for the dynamo exporter, and both graphs agree with torch in ONNX Runtime. The
exporter is part of the cache key, so switching exporters re-exports.
"""

from __future__ import annotations

import logging
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from rtx_plugins.backends.graph_runtime.cache import CacheKey, GraphCache, model_fingerprint
from rtx_plugins.backends.graph_runtime.fp8_qdq import (
    CALIBRATION_CHUNKS,
    CALIBRATION_LEN,
    FP8_OPSET,
    quantize_for_export,
)
from rtx_plugins.backends.graph_runtime.graph import INPUT_NAMES, OUTPUT_NAMES, DenseKVGraph
from rtxcore.contracts.backend import BackendOptions
from rtxcore.models.fingerprint import weights_fingerprint
from rtxcore.models.source import ModelSource

log = logging.getLogger(__name__)

MODEL_FILE = "model.onnx"
# Raise when graph.py's inputs, outputs or numerics change: cached exports of the old graph then stop matching.
GRAPH_VERSION = 1
_DYNAMIC_AXES = {
    "input_ids": {0: "batch", 1: "tokens"},
    "positions": {0: "batch", 1: "tokens"},
    "attention_bias": {0: "batch", 1: "tokens", 2: "keys"},
    "logits_rows": {0: "logits_rows"},
    "past_slots": {0: "batch", 1: "past"},
    "key_cache": {0: "layer_slots"},
    "value_cache": {0: "layer_slots"},
    "logits": {0: "logits_rows"},
    "present_keys": {1: "batch", 2: "tokens"},
    "present_values": {1: "batch", 2: "tokens"},
}


@dataclass(frozen=True, slots=True)
class ExportSettings:
    # Precision of the weights and activations in the graph ("float32", "float16").
    dtype: str = "float32"
    opset: int = 17
    # "fp8": linear layers as float8 Q/DQ around MatMul (fp8_qdq.py), at opset 19 at least; None: float weights.
    quantization: str | None = None

    def __post_init__(self) -> None:
        if self.quantization == "fp8" and self.opset < FP8_OPSET:
            object.__setattr__(self, "opset", FP8_OPSET)

    def as_key(self) -> dict:
        key = {"dtype": self.dtype, "opset": self.opset, "exporter": "torchscript", "graph_version": GRAPH_VERSION,
               "torch": torch.__version__}
        if self.quantization is not None:
            key["quantization"] = {"method": self.quantization, "calibration": [CALIBRATION_CHUNKS, CALIBRATION_LEN]}
        return key


@dataclass(frozen=True, slots=True)
class ExportedGraph:
    path: Path
    key: CacheKey
    # True when the file came from the cache (no export this start).
    cache_hit: bool
    # Seconds spent exporting (0 on a cache hit) and hashing the weights for the key.
    export_s: float
    fingerprint_s: float


def export_key(source: ModelSource, settings: ExportSettings, weights: str) -> CacheKey:
    return CacheKey("onnx", weights, model_fingerprint(source.config), settings.as_key())


def exported_graph(source: ModelSource, settings: ExportSettings, cache: GraphCache,
                   progress: Callable[[int, int], None] | None = None) -> ExportedGraph:
    """The ONNX file for ``source`` under ``settings``: from the cache, or exported into it now."""
    start = time.perf_counter()
    key = export_key(source, settings, weights_fingerprint(source))
    fingerprint_s = time.perf_counter() - start
    path = cache.lookup(key, MODEL_FILE)
    if path is not None:
        log.info("ONNX export cache hit: %s (key %s)", path, key.digest)
        return ExportedGraph(path, key, True, 0.0, fingerprint_s)
    start = time.perf_counter()
    path = cache.store(key, MODEL_FILE, lambda out: export_onnx(source, settings, out, progress))
    export_s = time.perf_counter() - start
    log.info("exported %s to ONNX in %.1fs: %s (key %s)", source.name, export_s, path, key.digest)
    return ExportedGraph(path, key, False, export_s, fingerprint_s)


def export_onnx(source: ModelSource, settings: ExportSettings, out: Path,
                progress: Callable[[int, int], None] | None = None) -> None:
    """Build the torch backend's model on the CPU, load the weights, and trace :class:`DenseKVGraph` into ``out``."""
    # The torch backend's own loader: the exported graph holds exactly the weights the torch backend would run.
    from rtx_plugins.backends.torch_backend.backend import TorchBackend

    loader = TorchBackend(BackendOptions(device="cpu", dtype=settings.dtype))
    loader.load(source, progress=progress)
    if settings.quantization == "fp8":
        quantize_for_export(loader, source)
    graph = DenseKVGraph(loader.model).eval()
    with torch.inference_mode(), warnings.catch_warnings():
        # The TorchScript exporter announces its deprecation on every call; the choice is deliberate (see above).
        warnings.simplefilter("ignore", category=DeprecationWarning)
        warnings.simplefilter("ignore", category=FutureWarning)
        torch.onnx.export(graph, example_inputs(source, loader.dtype), str(out), input_names=list(INPUT_NAMES),
                          output_names=list(OUTPUT_NAMES), dynamic_axes=_DYNAMIC_AXES, opset_version=settings.opset,
                          dynamo=False)


def example_inputs(source: ModelSource, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    """Inputs to trace with: sizes above 1 on every dynamic axis, so none is specialised to a constant."""
    cfg = source.config
    batch, tokens, past, slots = 2, 3, 4, 16
    cache = torch.zeros(cfg.num_layers * slots, cfg.num_kv_heads, cfg.head_dim, dtype=dtype)
    return (torch.ones(batch, tokens, dtype=torch.long),
            torch.arange(past, past + tokens).repeat(batch, 1),
            torch.zeros(batch, tokens, past + tokens, dtype=dtype),
            torch.tensor([tokens - 1, 2 * tokens - 1]),
            torch.arange(batch * past).reshape(batch, past),
            cache, cache.clone())
