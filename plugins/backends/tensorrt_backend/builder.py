"""Build a TensorRT engine from the ONNX export and serialize it into the graph cache.

The engine's key extends the ONNX export's key with everything the build adds (precision, profiles, workspace,
TensorRT's version), so an engine is rebuilt exactly when its ONNX file, its settings or TensorRT change.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path

from rtx_plugins.backends.graph_runtime.cache import CacheKey
from rtx_plugins.backends.tensorrt_backend.profiles import Profile
from rtxcore.errors import ConfigError, ModelLoadError

log = logging.getLogger(__name__)

ENGINE_FILE = "model.plan"
# Builder flag of each reduced precision; float32 needs none. Layers TensorRT cannot run in the reduced precision
# stay in float32 (weak typing), so the flag is a permission, not a guarantee.
PRECISION_FLAGS = {"float16": "FP16", "bfloat16": "BF16"}
# TensorRT builds fp8 layers only where the network has explicit float8 Q/DQ nodes, and only with this flag.
QUANTIZATION_FLAGS = {"fp8": "FP8"}


@dataclass(frozen=True, slots=True)
class BuildSettings:
    precision: str
    profiles: tuple[Profile, ...]
    workspace_bytes: int = 4 << 30
    # "fp8": the ONNX file carries float8 Q/DQ nodes, and the builder may run those layers in fp8.
    quantization: str | None = None

    def __post_init__(self) -> None:
        if self.precision != "float32" and self.precision not in PRECISION_FLAGS:
            raise ConfigError(f"tensorrt backend: precision {self.precision!r} is not one of float32, "
                              f"{', '.join(PRECISION_FLAGS)}")
        if self.quantization not in (None, *QUANTIZATION_FLAGS):
            raise ConfigError(f"tensorrt backend: quantization {self.quantization!r} is not one of "
                              f"{', '.join(QUANTIZATION_FLAGS)}")

    def builder_flags(self) -> list[str]:
        """The BuilderFlag names the build sets."""
        return [f for f in (PRECISION_FLAGS.get(self.precision), QUANTIZATION_FLAGS.get(self.quantization)) if f]

    def as_key(self) -> dict:
        return {"precision": self.precision, "quantization": self.quantization, "workspace_bytes": self.workspace_bytes,
                "profiles": {p.name: p.as_key() for p in self.profiles}}


def engine_key(onnx_key: CacheKey, settings: BuildSettings, tensorrt_version: str) -> CacheKey:
    return CacheKey("tensorrt", onnx_key.weights, onnx_key.model,
                    {"onnx": onnx_key.digest, "tensorrt": tensorrt_version, **settings.as_key()})


def build_engine(trt, onnx_path: Path, settings: BuildSettings, out: Path) -> None:
    """Parse ``onnx_path``, build with ``settings`` and write the serialized engine to ``out``."""
    start = time.perf_counter()
    logger = trt.Logger(trt.Logger.WARNING)
    builder = trt.Builder(logger)
    # Explicit batch is the only mode of TensorRT 10 (its flag is deprecated there) and must be asked for before.
    major = int(trt.__version__.split(".")[0])
    network = builder.create_network(0 if major >= 10 else 1 << int(trt.NetworkDefinitionCreationFlag.EXPLICIT_BATCH))
    parser = trt.OnnxParser(network, logger)
    if not parser.parse_from_file(str(onnx_path)):
        errors = "; ".join(str(parser.get_error(i)) for i in range(parser.num_errors))
        raise ModelLoadError(f"TensorRT could not parse {onnx_path}: {errors}")
    config = builder.create_builder_config()
    config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, settings.workspace_bytes)
    for flag in settings.builder_flags():
        if not hasattr(trt.BuilderFlag, flag):
            raise ConfigError(f"this TensorRT ({trt.__version__}) has no {flag} builder flag")
        config.set_flag(getattr(trt.BuilderFlag, flag))
    for spec in settings.profiles:
        profile = builder.create_optimization_profile()
        for name, r in spec.shapes.items():
            profile.set_shape(name, r.min, r.opt, r.max)
        config.add_optimization_profile(profile)
    serialized = builder.build_serialized_network(network, config)
    if serialized is None:
        raise ModelLoadError(f"TensorRT failed to build an engine from {onnx_path} (see its log above)")
    out.write_bytes(bytes(serialized))
    log.info("built TensorRT engine (%s, %d profiles) in %.1fs: %s", settings.precision, len(settings.profiles),
             time.perf_counter() - start, out)
