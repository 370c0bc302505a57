"""The tensorrt backend without TensorRT: it registers, reports itself unavailable with the import error, and is
refused with that reason; what it would build from (the ONNX export, its profiles, its cache keys) is checked for
real, the export by running it in ONNX Runtime at the profiles' shapes."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from rtx_plugins.backends.graph_runtime.cache import GraphCache
from rtx_plugins.backends.graph_runtime.dense_step import plan_calls
from rtx_plugins.backends.graph_runtime.exporter import ExportSettings, exported_graph
from rtx_plugins.backends.tensorrt_backend.builder import BuildSettings, engine_key
from rtx_plugins.backends.tensorrt_backend.profiles import (
    compute_profiles,
    pick_profile,
)
from rtxcore.contracts.backend import ForwardBatch
from rtxcore.engine.config import EngineConfig
from rtxcore.engine.llm import LLM
from rtxcore.errors import ConfigError, PluginError
from rtxcore.models.dummy import SHAPES, DummySource

RTX = str(Path(sys.executable).parent / "rtx")
without_tensorrt = pytest.mark.skipif(importlib.util.find_spec("tensorrt") is not None,
                                      reason="tensorrt is installed: the unavailable path cannot be shown here")
SMOLLM = SHAPES["smollm2-135m"]


@without_tensorrt
def test_plugins_list_shows_tensorrt_unavailable_with_the_import_error():
    listing = subprocess.run([RTX, "plugins", "list", "--json"], capture_output=True, text=True, timeout=120)
    assert listing.returncode == 0, listing.stderr
    record = next(p for p in json.loads(listing.stdout)["plugins"] if p["name"] == "tensorrt")
    assert record["kind"] == "backend" and record["available"] is False
    assert "No module named 'tensorrt'" in record["unavailable_reason"]
    assert record["capabilities"]["max_batch_size"] == 256
    # The table cuts lines at 100 columns; --verbose gives the whole reason.
    table = subprocess.run([RTX, "plugins", "list"], capture_output=True, text=True, timeout=120).stdout
    assert "unavailable: cannot import tensor" in table
    verbose = subprocess.run([RTX, "plugins", "list", "--verbose"], capture_output=True, text=True, timeout=120).stdout
    assert "cannot import tensorrt: ModuleNotFoundError: No module named 'tensorrt'" in verbose


@without_tensorrt
def test_serve_with_tensorrt_exits_2_with_the_reason_in_one_line():
    r = subprocess.run([RTX, "serve", "--backend", "tensorrt", "--model", "dummy:tiny", "--host", "127.0.0.1",
                        "--port", "0", "--no-grpc"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2
    assert r.stderr.strip() == ("rtx: error: backend 'tensorrt' is unavailable: cannot import tensorrt: "
                                "ModuleNotFoundError: No module named 'tensorrt'")


@without_tensorrt
def test_engine_refuses_tensorrt_before_loading(registry):
    with pytest.raises(PluginError, match="backend 'tensorrt' is unavailable: cannot import tensorrt"):
        LLM(EngineConfig(model="dummy:tiny", backend="tensorrt"), registry=registry)


def _step(block_size: int = 4) -> ForwardBatch:
    """Two decodes (contexts 7 and 3) and a 5-token prefill chunk after 4 cached tokens."""
    qsl, seq_lens = [0, 1, 2, 7], [7, 3, 9]
    tables = torch.tensor([[1, 2, 0], [3, 0, 0], [4, 5, 6]], dtype=torch.int32)
    positions = torch.tensor([6, 2, 4, 5, 6, 7, 8])
    slots = torch.tensor([2 * block_size + 2, 3 * block_size + 2, 5 * block_size, 5 * block_size + 1,
                          5 * block_size + 2, 5 * block_size + 3, 6 * block_size])
    return ForwardBatch(torch.arange(10, 17), positions, qsl, seq_lens, tables, slots, torch.tensor([0, 1, 6]),
                        block_size=block_size, num_decodes=2)


def test_profiles_cover_the_calls_the_backend_makes():
    decode, prefill = compute_profiles(SMOLLM, max_batch=64, max_model_len=1024, num_slots=4096)
    assert decode.shapes["input_ids"].max == (64, 1) and decode.shapes["past_slots"].max == (64, 1023)
    assert prefill.shapes["input_ids"].max == (1, 1024) and prefill.shapes["attention_bias"].opt == (1, 512, 513)
    assert decode.shapes["key_cache"].min == decode.shapes["key_cache"].max == (30 * 4096, 3, 64)
    profiles = compute_profiles(SMOLLM, 8, 64, 64)
    calls = plan_calls(_step(), np.float32)
    shapes = [{name: a.shape for name, a in c.feeds.items()} for c in calls]
    assert [pick_profile(profiles, s) for s in shapes] == [0, 1]
    too_long = {**shapes[1], "input_ids": (1, 65)}
    with pytest.raises(ValueError, match="no optimization profile"):
        pick_profile(profiles, too_long)
    with pytest.raises(ValueError):
        compute_profiles(SMOLLM, 0, 64, 64)


def test_dense_step_gathers_past_slots_and_masks_padding():
    decodes, prefill = plan_calls(_step(), np.float32)
    # Decodes: contexts 7 and 3, so 6 and 2 past tokens, padded to 6 (padding reads the null slot 0).
    assert decodes.feeds["past_slots"].tolist() == [[4, 5, 6, 7, 8, 9], [12, 13, 0, 0, 0, 0]]
    bias = decodes.feeds["attention_bias"]
    assert bias.shape == (2, 1, 7) and (bias[1, 0, 2:6] < -1e8).all() and (bias[1, 0, [0, 1, 6]] == 0).all()
    # The chunk: 4 cached tokens in block 4, then 5 new ones attending causally.
    assert prefill.feeds["past_slots"].tolist() == [[16, 17, 18, 19]]
    assert prefill.feeds["positions"].tolist() == [[4, 5, 6, 7, 8]]
    assert (prefill.feeds["attention_bias"][0, :, 4:] == np.triu(np.full((5, 5), -1e9, np.float32), 1)).all()
    # Each call computes the logits rows it holds, and says where they go among the batch's logits_indices.
    assert decodes.feeds["logits_rows"].tolist() == [0, 1] and decodes.logits_positions.tolist() == [0, 1]
    assert prefill.feeds["logits_rows"].tolist() == [4] and prefill.logits_positions.tolist() == [2]
    scoring = _step()
    scoring.logits_indices = torch.tensor([3, 4, 5])
    decodes, prefill = plan_calls(scoring, np.float32)
    assert decodes.logits_positions.tolist() == [] and len(decodes.feeds["logits_rows"]) == 1
    assert prefill.feeds["logits_rows"].tolist() == [1, 2, 3] and prefill.logits_positions.tolist() == [0, 1, 2]


def test_engine_key_changes_with_what_the_engine_depends_on(tmp_path):
    graph = exported_graph(DummySource("tiny"), ExportSettings(), GraphCache(tmp_path))
    profiles = compute_profiles(SHAPES["tiny"], 8, 64, 256)
    base = engine_key(graph.key, BuildSettings("float16", profiles), "10.9.0")
    assert base == engine_key(graph.key, BuildSettings("float16", profiles), "10.9.0")
    others = [engine_key(graph.key, BuildSettings("bfloat16", profiles), "10.9.0"),
              engine_key(graph.key, BuildSettings("float16", compute_profiles(SHAPES["tiny"], 16, 64, 256)), "10.9.0"),
              engine_key(graph.key, BuildSettings("float16", profiles), "10.10.0"),
              engine_key(exported_graph(DummySource("tiny", seed=1), ExportSettings(), GraphCache(tmp_path)).key,
                         BuildSettings("float16", profiles), "10.9.0")]
    assert len({base.digest, *(k.digest for k in others)}) == 5
    assert base.kind == "tensorrt" and base.settings["onnx"] == graph.key.digest
    with pytest.raises(ConfigError, match="precision 'int4'"):
        BuildSettings("int4", profiles)


def test_export_is_reused_until_its_key_changes(tmp_path):
    cache = GraphCache(tmp_path)
    first = exported_graph(DummySource("tiny"), ExportSettings(), cache)
    again = exported_graph(DummySource("tiny"), ExportSettings(), cache)
    other = exported_graph(DummySource("tiny"), ExportSettings(opset=18), cache)
    assert not first.cache_hit and again.cache_hit and not other.cache_hit
    assert again.path == first.path and other.path != first.path
    assert json.loads((first.path.parent / "key.json").read_text())["settings"]["opset"] == 17


def test_the_export_tensorrt_would_parse_runs_at_its_profile_shapes(tmp_path):
    onnx = pytest.importorskip("onnx")
    ort = pytest.importorskip("onnxruntime")
    cfg = SHAPES["tiny"]
    graph = exported_graph(DummySource("tiny"), ExportSettings(), GraphCache(tmp_path))
    model = onnx.load(str(graph.path))
    onnx.checker.check_model(model)
    inputs = {i.name: i.type.tensor_type.shape.dim for i in model.graph.input}
    session = ort.InferenceSession(str(graph.path), providers=["CPUExecutionProvider"])
    num_slots = 32
    for profile in compute_profiles(cfg, max_batch=4, max_model_len=16, num_slots=num_slots):
        assert set(profile.shapes) == set(inputs)
        for name, r in profile.shapes.items():
            dims = inputs[name]
            assert len(dims) == len(r.min)
            # Axes the graph fixes are fixed in the profile too, with the same size.
            for axis, dim in enumerate(dims):
                if dim.HasField("dim_value"):
                    assert r.min[axis] == r.max[axis] == dim.dim_value, (profile.name, name, axis)
        for end in ("min", "opt", "max"):
            shapes = {name: getattr(r, end) for name, r in profile.shapes.items()}
            logits, keys, _ = session.run(None, _feeds(shapes, num_slots))
            b, t = shapes["input_ids"]
            assert logits.shape == (shapes["logits_rows"][0], cfg.vocab_size)
            assert keys.shape == (cfg.num_layers, b, t, cfg.num_kv_heads, cfg.head_dim)
            assert np.isfinite(logits).all()


def _feeds(shapes: dict[str, tuple[int, ...]], num_slots: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    b, t = shapes["input_ids"]
    p = shapes["past_slots"][1]
    return {"input_ids": rng.integers(0, 100, (b, t)), "positions": np.tile(np.arange(p, p + t), (b, 1)),
            "attention_bias": np.zeros(shapes["attention_bias"], np.float32),
            "logits_rows": rng.integers(0, b * t, shapes["logits_rows"]),
            "past_slots": rng.integers(0, num_slots, (b, p)),
            "key_cache": rng.standard_normal(shapes["key_cache"], np.float32),
            "value_cache": rng.standard_normal(shapes["value_cache"], np.float32)}
