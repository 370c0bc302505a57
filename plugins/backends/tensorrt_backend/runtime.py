"""Run a serialized TensorRT engine: one execution context per optimization profile, all on one CUDA stream.

Inputs and outputs are device tensors whose addresses are bound to the context before each enqueue; the KV cache is
bound in place.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from rtx_plugins.backends.graph_runtime.dense_backend import GraphOutputs
from rtx_plugins.backends.graph_runtime.graph import OUTPUT_NAMES
from rtx_plugins.backends.tensorrt_backend.profiles import Profile, pick_profile
from rtxcore.errors import ModelLoadError


class TrtGraphRunner:
    def __init__(self, trt, engine_path: Path, profiles: tuple[Profile, ...], device: torch.device):
        self.device = device
        self.profiles = profiles
        runtime = trt.Runtime(trt.Logger(trt.Logger.WARNING))
        self.engine = runtime.deserialize_cuda_engine(engine_path.read_bytes())
        if self.engine is None:
            raise ModelLoadError(f"TensorRT could not deserialize {engine_path} (built by another version?)")
        self.stream = torch.cuda.Stream(device)
        self.contexts = []
        for index in range(len(profiles)):
            context = self.engine.create_execution_context()
            context.set_optimization_profile_async(index, self.stream.cuda_stream)
            self.contexts.append(context)
        self.output_dtypes = {name: torch.from_numpy(np.empty(0, trt.nptype(self.engine.get_tensor_dtype(name)))).dtype
                              for name in OUTPUT_NAMES}

    def run(self, feeds: dict[str, np.ndarray], key_cache: torch.Tensor, value_cache: torch.Tensor) -> GraphOutputs:
        shapes = {name: tuple(array.shape) for name, array in feeds.items()}
        context = self.contexts[pick_profile(self.profiles, shapes)]
        with torch.cuda.stream(self.stream):
            inputs = {name: torch.from_numpy(array).to(self.device, non_blocking=True) for name, array in feeds.items()}
            inputs.update(key_cache=key_cache, value_cache=value_cache)
            for name, tensor in inputs.items():
                context.set_input_shape(name, tuple(tensor.shape))
                context.set_tensor_address(name, tensor.data_ptr())
            outputs = {}
            for name in OUTPUT_NAMES:
                outputs[name] = torch.empty(tuple(context.get_tensor_shape(name)), dtype=self.output_dtypes[name],
                                            device=self.device)
                context.set_tensor_address(name, outputs[name].data_ptr())
            if not context.execute_async_v3(self.stream.cuda_stream):
                raise RuntimeError("TensorRT failed to enqueue the step")
            host = [outputs[name].to("cpu", non_blocking=True) for name in OUTPUT_NAMES]
        self.stream.synchronize()
        return GraphOutputs(*(t.numpy() for t in host))
