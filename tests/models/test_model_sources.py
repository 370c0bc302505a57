"""Model sources: a Hugging Face directory loads the same model as the weights it was written from."""

from __future__ import annotations

import json
import re

import pytest
import torch
from safetensors.torch import save_file

from rtxcore.errors import ModelLoadError
from rtxcore.models.dummy import DummySource
from rtxcore.models.resolve import resolve_model
from rtxcore.sampling_params import SamplingParams
from tests.helpers.engines import make_engine


def test_hf_directory_round_trip(tmp_path, registry):
    source = DummySource("tiny")
    (tmp_path / "config.json").write_text(json.dumps(source.config.to_hf()))
    save_file({name: t.contiguous() for name, t in source.weights()}, str(tmp_path / "model.safetensors"))
    loaded = resolve_model(str(tmp_path))
    assert loaded.config.num_layers == source.config.num_layers
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    prompt = [11, 22, 33, 44, 55]
    from_dir = make_engine(registry=registry, source=loaded).generate([prompt], params)[0].token_ids
    from_dummy = make_engine(registry=registry).generate([prompt], params)[0].token_ids
    assert from_dir == from_dummy


def test_hf_directory_errors_name_the_problem(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(ModelLoadError, match="unsupported architecture"):
        resolve_model(str(tmp_path))
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match="unreadable config"):
        resolve_model(str(tmp_path))
    with pytest.raises(ModelLoadError, match="model not found"):
        resolve_model(str(tmp_path / "missing"))
    with pytest.raises(ModelLoadError, match="unknown dummy shape"):
        resolve_model("dummy:nope")


@pytest.mark.parametrize("edit, message", [
    # one part of a merged layer (q of q|k|v) missing: the others once marked the whole layer loaded
    (lambda w: w.pop("model.layers.0.self_attn.q_proj.weight"), "lacks weights: model.layers.0.self_attn.q_proj"),
    (lambda w: w.pop("model.layers.1.mlp.gate_proj.weight"), "lacks weights: model.layers.1.mlp.gate_proj"),
    (lambda w: w.pop("model.embed_tokens.weight"), "lacks weights: model.embed_tokens.weight"),
    # shapes copy_ would broadcast or fail on deep inside torch
    (lambda w: w.update({"model.layers.0.mlp.up_proj.weight": w["model.layers.0.mlp.up_proj.weight"][:, :1]}),
     "'model.layers.0.mlp.up_proj.weight' has shape [128, 1], expected [128, 64]"),
    (lambda w: w.update({"model.norm.weight": torch.ones(3)}), "'model.norm.weight' has shape [3], expected [64]"),
    (lambda w: w.update({"model.embed_tokens.weight": w["model.embed_tokens.weight"][:1]}), "expected [512, 64]"),
    (lambda w: w.update({"model.layers.0.self_attn.o_proj.weight": torch.ones(64, 3)}), "expected [64, 64]"),
])
def test_a_checkpoint_with_a_missing_or_misshapen_tensor_is_refused(tmp_path, registry, edit, message):
    source = DummySource("tiny")
    (tmp_path / "config.json").write_text(json.dumps(source.config.to_hf()))
    weights = {name: t.contiguous() for name, t in source.weights()}
    edit(weights)
    save_file({k: v.contiguous() for k, v in weights.items()}, str(tmp_path / "model.safetensors"))
    with pytest.raises(ModelLoadError, match=re.escape(message)):
        make_engine(registry=registry, source=resolve_model(str(tmp_path)))


@pytest.mark.parametrize("config", [
    [1, 2],
    {"hidden_size": "64"},
    {"vocab_size": None},
    {"rope_scaling": "linear"},
])
def test_a_malformed_config_is_a_model_load_error(tmp_path, config):
    source = DummySource("tiny")
    (tmp_path / "config.json").write_text(json.dumps(config if isinstance(config, list)
                                                     else {**source.config.to_hf(), **config}))
    save_file({name: t.contiguous() for name, t in source.weights()}, str(tmp_path / "model.safetensors"))
    with pytest.raises(ModelLoadError, match="malformed model config or metadata"):
        resolve_model(str(tmp_path))


def test_qwen2_style_attention_bias_and_llama3_rope_scaling(tmp_path, registry):
    source = DummySource("tiny")
    cfg = source.config.to_hf()
    cfg.update(model_type="qwen2", architectures=["Qwen2ForCausalLM"], attention_bias=True,
               rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                             "original_max_position_embeddings": 256})
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    weights = {name: t.contiguous() for name, t in source.weights()}
    for i in range(source.config.num_layers):
        for proj, size in (("q", source.config.num_heads), ("k", source.config.num_kv_heads),
                           ("v", source.config.num_kv_heads)):
            weights[f"model.layers.{i}.self_attn.{proj}_proj.bias"] = torch.randn(size * source.config.head_dim)
    save_file(weights, str(tmp_path / "model.safetensors"))
    loaded = resolve_model(str(tmp_path))
    assert loaded.config.attention_bias and loaded.config.rope_scaling.kind == "llama3"
    # Long enough to reach positions where the scaled rotary frequencies differ from plain ones.
    prompt = [(7 * i) % 500 + 3 for i in range(300)]
    ours = make_engine(registry=registry, source=loaded).generate(
        [prompt], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))[0].token_ids
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        ref = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False, pad_token_id=0)
    assert ours == ref[0, len(prompt):].tolist()
