"""A plan laid over a deeper model of the same architecture (rtxcore.quant.plan_layout): each layer takes the formats
of the planned layer at its relative depth, and an engine runs the result."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rtxcore.bench.engine import build_engine, generate
from rtxcore.errors import ConfigError
from rtxcore.models.resolve import resolve_model
from rtxcore.quant.plan_layout import LaidOutSource, read_plan
from rtxcore.registry import load_plugins
from rtxcore.sampling_params import SamplingParams

ATTN = ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight", "self_attn.o_proj.weight")
MLP = ("mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight")


def write_plan(directory: Path, num_layers: int, methods: dict[str, str]) -> Path:
    directory.mkdir(exist_ok=True)
    layers = {name: {"method": method, "shape": [1, 1], "meta": {}, "tensors": ["weight"]}
              for name, method in methods.items()}
    config = {"num_hidden_layers": num_layers, "quantization_config": {"quant_method": "rtx-serve",
                                                                       "rtx": {"layers": layers, "method": "int4"}}}
    (directory / "config.json").write_text(json.dumps(config))
    return directory


def test_each_layer_takes_the_formats_of_the_planned_layer_at_its_relative_depth(tmp_path):
    # Two planned layers: the first all int8 but its MLP's down projection left in float, the second fp8.
    methods = {f"model.layers.0.{p}": "int8" for p in (*ATTN, *MLP[:2])}
    methods |= {f"model.layers.1.{p}": "fp8" for p in (*ATTN, *MLP)}
    layout = read_plan(write_plan(tmp_path / "plan", 2, methods))
    assert layout.num_layers == 2 and layout.method == "int4"
    # Layers 0 and 1 of four lie in the first half, 2 and 3 in the second.
    assert [layout.method_for(f"model.layers.{j}.self_attn.q_proj.weight", 4) for j in range(4)] == \
        ["int8", "int8", "fp8", "fp8"]
    assert layout.method_for("model.layers.1.mlp.down_proj.weight", 4) is None
    assert layout.method_for("model.layers.3.mlp.down_proj.weight", 4) == "fp8"
    # Weights outside the decoder layers are never planned.
    for name in ("lm_head.weight", "model.embed_tokens.weight", "model.norm.weight"):
        assert layout.method_for(name, 4) is None
    names = [f"model.layers.{j}.{p}" for j in range(4) for p in (*ATTN, *MLP, "input_layernorm.weight")]
    # Norms and weights outside the layers are not counted: the plan never quantizes them.
    assert layout.counts([*names, "lm_head.weight"], 4) == {"int8": 12, "float": 2, "fp8": 14}


def test_a_plan_laid_over_a_model_runs_as_the_same_formats_quantized_at_load(tmp_path):
    # A one-layer plan, int8 everywhere, laid over the two layers of dummy:tiny: both layers int8, and the engine's
    # greedy tokens are those of --quantization int8 (the same plain rounding, done by the backend at load).
    registry = load_plugins()
    plan = write_plan(tmp_path / "plan", 1, {f"model.layers.0.{p}": "int8" for p in (*ATTN, *MLP)})
    source = LaidOutSource(resolve_model("dummy:tiny"), read_plan(plan),
                           lambda method: registry.create("quantizer", method))
    assert source.quantization_methods() == ("int8",)
    laid_out = build_engine(source=source, model="dummy:tiny", device="cpu", dtype="float32")
    layers = laid_out.core.backend.model.linear_layers()
    assert len(layers) == 8 and all(layer.quantized is not None for layer in layers.values())
    assert {layer.quantized.qtensor.method for layer in layers.values()} == {"int8"}
    prompts = [[1, 5, 9, 200, 17], [1, 42, 43, 44]]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    quantized = build_engine(model="dummy:tiny", device="cpu", dtype="float32", quantization="int8")
    tokens = [[out.token_ids for out in generate(engine, prompts, params)] for engine in (laid_out, quantized)]
    assert tokens[0] == tokens[1]
    assert len(tokens[0][0]) == 12


@pytest.mark.parametrize("content, message", [
    (None, "cannot read config.json"),
    ("{not json", "is not JSON"),
    (json.dumps({"num_hidden_layers": 30}), "not the config of a checkpoint `rtx quantize` wrote"),
    (json.dumps({"num_hidden_layers": 2, "quantization_config": {"rtx": {"layers": {"lm_head.weight": {
        "method": "int8"}}}}}), "'lm_head.weight' is not a decoder weight"),
])
def test_a_file_that_is_no_plan_is_refused_naming_it(tmp_path, content, message):
    if content is not None:
        (tmp_path / "config.json").write_text(content)
    with pytest.raises(ConfigError, match=message) as info:
        read_plan(tmp_path)
    assert str(tmp_path) in str(info.value)
