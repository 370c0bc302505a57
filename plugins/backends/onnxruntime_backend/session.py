"""An ONNX Runtime session over the dense KV-cache graph, with the execution provider chosen once.

The engine's cache is bound by pointer (I/O binding), so each call hands ONNX Runtime the cache buffer in place,
on the CPU or the GPU, instead of a copy of it.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from rtx_plugins.backends.graph_runtime.dense_backend import NUMPY_DTYPES, GraphOutputs
from rtx_plugins.backends.graph_runtime.graph import OUTPUT_NAMES
from rtxcore import envs
from rtxcore.errors import ConfigError

PROVIDERS = {"cpu": "CPUExecutionProvider", "cuda": "CUDAExecutionProvider"}


def choose_device(requested: str) -> str:
    """``cpu`` or ``cuda``: ``requested`` unless "auto", then ``$RTX_ORT_PROVIDER``, then CUDA where onnxruntime-gpu
    offers it (and torch, which holds the cache, sees a GPU), else the CPU."""
    import onnxruntime as ort

    choice = requested.split(":")[0] if requested != "auto" else envs.RTX_ORT_PROVIDER.get()
    available = ort.get_available_providers()
    cuda_ok = PROVIDERS["cuda"] in available and torch.cuda.is_available()
    if choice == "auto":
        return "cuda" if cuda_ok else "cpu"
    if choice not in PROVIDERS:
        raise ConfigError(f"onnxruntime backend: device {choice!r} is not one of cpu, cuda, auto")
    if choice == "cuda" and not cuda_ok:
        raise ConfigError("onnxruntime backend: the CUDA provider needs onnxruntime-gpu and a GPU torch can see "
                          f"(providers here: {', '.join(available)})")
    return choice


class OrtGraphSession:
    def __init__(self, path: Path, device: str, num_threads: int):
        import onnxruntime as ort

        options = ort.SessionOptions()
        options.intra_op_num_threads = num_threads
        options.log_severity_level = 3  # warnings about unused initializers and the like are noise here
        self.session = ort.InferenceSession(str(path), options, providers=[PROVIDERS[device]])

    def run(self, feeds: dict[str, np.ndarray], key_cache: torch.Tensor, value_cache: torch.Tensor) -> GraphOutputs:
        binding = self.session.io_binding()
        for name, array in feeds.items():
            binding.bind_cpu_input(name, array)
        for name, cache in (("key_cache", key_cache), ("value_cache", value_cache)):
            binding.bind_input(name, cache.device.type, cache.device.index or 0, NUMPY_DTYPES[cache.dtype],
                               list(cache.shape), cache.data_ptr())
        for name in OUTPUT_NAMES:
            binding.bind_output(name, "cpu")
        self.session.run_with_iobinding(binding)
        return GraphOutputs(*binding.copy_outputs_to_cpu())

