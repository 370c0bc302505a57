"""The TensorRT execution backend: an engine built from the same ONNX export as the onnxruntime backend's, cached on
disk beside it, run on a CUDA stream over the engine's paged KV cache.

Where ``tensorrt`` cannot be imported the class still registers; its capabilities say it is unavailable and why,
and the engine refuses to start it with that reason.
"""

from __future__ import annotations

import logging
from types import ModuleType

import numpy as np
import torch

from rtx_plugins.backends.graph_runtime.dense_backend import DenseGraphBackend, GraphOutputs, check_options
from rtx_plugins.backends.graph_runtime.exporter import ExportedGraph
from rtx_plugins.backends.graph_runtime.fp8_qdq import graph_quantization
from rtx_plugins.backends.tensorrt_backend.builder import ENGINE_FILE, BuildSettings, build_engine, engine_key
from rtx_plugins.backends.tensorrt_backend.profiles import compute_profiles
from rtxcore.contracts.backend import BackendCapabilities, BackendOptions
from rtxcore.errors import ConfigError

log = logging.getLogger(__name__)

# The decode profile's largest batch: the engine is built for it, so the engine refuses larger max_num_seqs.
MAX_BATCH = 256
PRECISIONS = ("float32", "float16", "bfloat16")


def import_tensorrt() -> tuple[ModuleType | None, str | None]:
    """``(tensorrt, None)``, or ``(None, why not)`` with the import error as Python reported it."""
    try:
        import tensorrt
    except Exception as exc:  # ImportError, or a broken install failing inside its own import
        return None, f"cannot import tensorrt: {type(exc).__name__}: {exc}"
    return tensorrt, None


class TensorRTBackend(DenseGraphBackend):
    @classmethod
    def capabilities(cls) -> BackendCapabilities:
        trt, reason = import_tensorrt()
        if trt is not None and not torch.cuda.is_available():
            reason = "TensorRT needs a CUDA GPU and torch sees none"
        # fp8: the export's Q/DQ nodes (fp8_qdq.py) built into fp8 layers on GPUs with fp8 tensor cores.
        return BackendCapabilities(devices=("cuda",), dtypes=PRECISIONS, paged_kv=True, kv_offload=True,
                                   max_batch_size=MAX_BATCH, quantization_formats=("fp8",),
                                   available=reason is None, unavailable_reason=reason)

    def __init__(self, options: BackendOptions):
        trt, reason = import_tensorrt()
        if trt is None:
            raise ConfigError(f"backend 'tensorrt' is unavailable: {reason}")
        if options.device not in ("auto", "cuda") and not options.device.startswith("cuda:"):
            raise ConfigError(f"backend 'tensorrt' runs on CUDA only, not {options.device!r}")
        self.precision = check_options("tensorrt", self.capabilities(), "cuda", options)
        # The ONNX graph stays float32 (and so do its inputs, outputs and the KV cache); the precision is a builder
        # flag that lets TensorRT run layers in float16 or bfloat16.
        device = options.device if options.device != "auto" else "cuda"
        super().__init__(options, device, "float32")
        self.trt = trt
        self.onnx_graph: ExportedGraph | None = None
        self.runner = None
        # Whether this start's engine came from the cache.
        self.engine_cache_hit = False

    def _open(self, graph: ExportedGraph) -> None:
        # The engine's profiles include the cache's size, known only at allocate_kv_cache: it is built there.
        self.onnx_graph = graph

    def allocate_kv_cache(self, num_blocks: int, block_size: int) -> None:
        from rtx_plugins.backends.tensorrt_backend.runtime import TrtGraphRunner

        super().allocate_kv_cache(num_blocks, block_size)
        cfg = self.model_config
        max_len = min(cfg.max_position, self.options.max_model_len or cfg.max_position)
        profiles = compute_profiles(cfg, self.options.max_batch_size, max_len, num_blocks * block_size)
        settings = BuildSettings(self.precision, profiles, quantization=graph_quantization(self.options))
        key = engine_key(self.onnx_graph.key, settings, self.trt.__version__)
        path = self.graph_cache.lookup(key, ENGINE_FILE)
        self.engine_cache_hit = path is not None
        if path is None:
            path = self.graph_cache.store(key, ENGINE_FILE,
                                          lambda out: build_engine(self.trt, self.onnx_graph.path, settings, out))
        log.info("tensorrt backend: engine %s (%s)", path, "cache hit" if self.engine_cache_hit else "built")
        self.runner = TrtGraphRunner(self.trt, path, profiles, self._device)

    def _run(self, feeds: dict[str, np.ndarray], key_cache: torch.Tensor, value_cache: torch.Tensor) -> GraphOutputs:
        return self.runner.run(feeds, key_cache, value_cache)
