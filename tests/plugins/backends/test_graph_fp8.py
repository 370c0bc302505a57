"""fp8 in the graph backends' export: float8 Q/DQ nodes TensorRT would build into fp8 layers, run here by ONNX
Runtime on the CPU and checked against the same rounding done in torch."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from rtxcore.contracts.backend import BackendOptions
from rtxcore.engine.config import EngineConfig
from rtxcore.engine.llm import LLM
from rtxcore.errors import ConfigError
from rtxcore.models.dummy import SHAPES, DummySource
from rtxcore.quant.evaluation import prefill_logits
from rtxcore.sampling_params import SamplingParams

onnx = pytest.importorskip("onnx")
pytest.importorskip("onnxruntime")
from rtx_plugins.backends.graph_runtime.cache import CACHE_DIR_ENV, GraphCache  # noqa: E402
from rtx_plugins.backends.graph_runtime.exporter import ExportSettings, exported_graph  # noqa: E402
from rtx_plugins.backends.graph_runtime.fp8_qdq import FP8_OPSET, quantize_for_export  # noqa: E402
from rtx_plugins.backends.tensorrt_backend.builder import BuildSettings, engine_key  # noqa: E402
from rtx_plugins.backends.tensorrt_backend.profiles import compute_profiles  # noqa: E402
from rtx_plugins.backends.torch_backend.backend import TorchBackend  # noqa: E402

IDS = list(range(5, 60))


def _torch_logits(static_fp8: bool) -> torch.Tensor:
    backend = TorchBackend(BackendOptions("cpu", "float32"))
    source = DummySource("tiny")
    backend.load(source)
    if static_fp8:
        quantize_for_export(backend, source)
    backend.allocate_kv_cache(8, 16)
    return prefill_logits(backend, IDS)


def test_export_has_float8_qdq_around_every_linear_layer(tmp_path):
    graph = exported_graph(DummySource("tiny"), ExportSettings(quantization="fp8"), GraphCache(tmp_path))
    model = onnx.load(str(graph.path))
    onnx.checker.check_model(model)
    assert model.opset_import[0].version == FP8_OPSET
    quantize = [n for n in model.graph.node if n.op_type == "QuantizeLinear"]
    # q|k|v, o, gate|up and down in each layer: one activation Q/DQ and one weight DQ each.
    layers = SHAPES["tiny"].num_layers
    assert len(quantize) == 4 * layers
    assert sum(n.op_type == "DequantizeLinear" for n in model.graph.node) == 8 * layers
    float8 = onnx.TensorProto.FLOAT8E4M3FN
    constants = [a.t for n in model.graph.node if n.op_type == "Constant" for a in n.attribute if a.name == "value"]
    assert sum(c.data_type == float8 and len(c.dims) == 2 for c in constants) == 4 * layers  # the weights
    float_graph = exported_graph(DummySource("tiny"), ExportSettings(), GraphCache(tmp_path))
    assert graph.key.digest != float_graph.key.digest


def test_onnxruntime_runs_the_fp8_graph_as_torch_rounds_it(tmp_path, monkeypatch):
    monkeypatch.setenv(CACHE_DIR_ENV, str(tmp_path))
    engine = LLM(EngineConfig(model="dummy:tiny", backend="onnxruntime", quantization="fp8", num_kv_blocks=16))
    assert engine.core.backend.graph.path.parent.joinpath("key.json").read_text().count('"fp8"') == 1
    got = prefill_logits(engine.core.backend, IDS)
    same_rounding, exact = _torch_logits(True), _torch_logits(False)
    assert ((got - same_rounding).norm() / same_rounding.norm()).item() < 1e-4
    # fp8 rounding is visible, and bounded (e4m3 keeps 3 mantissa bits).
    error = ((got - exact).norm() / exact.norm()).item()
    assert 1e-4 < error < 0.1, error
    out = engine.generate([IDS[:8]], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))[0]
    assert len(out.token_ids) == 4


def test_graph_backends_refuse_other_quantizers(tmp_path, monkeypatch):
    monkeypatch.setenv(CACHE_DIR_ENV, str(tmp_path))
    with pytest.raises(Exception, match="cannot run 'int4' weights.*accepts: fp8"):
        LLM(EngineConfig(model="dummy:tiny", backend="onnxruntime", quantization="int4"))


def test_tensorrt_fp8_build_settings(tmp_path):
    profiles = compute_profiles(SHAPES["tiny"], 8, 64, 256)
    fp8 = BuildSettings("float16", profiles, quantization="fp8")
    assert fp8.builder_flags() == ["FP16", "FP8"]
    assert BuildSettings("float16", profiles).builder_flags() == ["FP16"]
    graph = exported_graph(DummySource("tiny"), ExportSettings(quantization="fp8"), GraphCache(Path(tmp_path)))
    assert (engine_key(graph.key, fp8, "10.9.0").digest
            != engine_key(graph.key, BuildSettings("float16", profiles), "10.9.0").digest)
    with pytest.raises(ConfigError, match="quantization 'int4'"):
        BuildSettings("float16", profiles, quantization="int4")
