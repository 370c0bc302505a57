"""The ONNX Runtime execution backend: the model exported once to ONNX (cached on disk), run by ONNX Runtime over
the engine's paged KV cache. CPU provider everywhere; CUDA provider where onnxruntime-gpu is installed."""

from __future__ import annotations

import importlib.util
import logging
import time

import numpy as np
import torch

from rtx_plugins.backends.graph_runtime.dense_backend import DenseGraphBackend, GraphOutputs, check_options
from rtx_plugins.backends.graph_runtime.exporter import ExportedGraph
from rtxcore.contracts.backend import BackendCapabilities, BackendOptions

log = logging.getLogger(__name__)


class OnnxRuntimeBackend(DenseGraphBackend):
    @classmethod
    def capabilities(cls) -> BackendCapabilities:
        # The export needs onnx; running needs onnxruntime. Checked without importing them (import is slow).
        missing = [name for name in ("onnxruntime", "onnx") if importlib.util.find_spec(name) is None]
        if missing:
            return BackendCapabilities(devices=(), dtypes=(), paged_kv=True, available=False,
                                       unavailable_reason=f"missing Python package(s): {', '.join(missing)} "
                                                          "(pip install onnx onnxruntime)")
        import onnxruntime as ort

        cuda = "CUDAExecutionProvider" in ort.get_available_providers() and torch.cuda.is_available()
        return BackendCapabilities(
            devices=("cpu", "cuda") if cuda else ("cpu",),
            # ONNX Runtime's CPU kernels for float16 are few and slow; on the CPU it runs float32 only.
            dtypes=("float32", "float16") if cuda else ("float32",),
            # fp8 as Q/DQ nodes in the export (fp8_qdq.py); on the CPU they run as rounding around float MatMuls.
            paged_kv=True, kv_offload=True, quantization_formats=("fp8",))

    def __init__(self, options: BackendOptions):
        from rtx_plugins.backends.onnxruntime_backend.session import choose_device

        device = choose_device(options.device)
        dtype = check_options("onnxruntime", self.capabilities(), device, options)
        super().__init__(options, device, dtype)
        self.session = None
        # Seconds ONNX Runtime took to load and optimise the graph this start.
        self.session_s = 0.0

    def _open(self, graph: ExportedGraph) -> None:
        from rtx_plugins.backends.onnxruntime_backend.session import OrtGraphSession

        start = time.perf_counter()
        self.session = OrtGraphSession(graph.path, self._device.type, torch.get_num_threads())
        self.session_s = time.perf_counter() - start
        log.info("onnxruntime backend: %s on %s, export %s (%.1fs), session ready in %.1fs", graph.path.name,
                 self._device.type, "cache hit" if graph.cache_hit else "new", graph.export_s, self.session_s)

    def _damaged_graph(self, exc: Exception) -> bool:
        from onnxruntime.capi import onnxruntime_pybind11_state as ort_errors

        # What InferenceSession raises for a file cut short (InvalidProtobuf), emptied (InvalidArgument), gone or
        # not a valid graph.
        return isinstance(exc, (ort_errors.InvalidProtobuf, ort_errors.InvalidArgument, ort_errors.InvalidGraph,
                                ort_errors.NoSuchFile))

    def _run(self, feeds: dict[str, np.ndarray], key_cache: torch.Tensor, value_cache: torch.Tensor) -> GraphOutputs:
        return self.session.run(feeds, key_cache, value_cache)
