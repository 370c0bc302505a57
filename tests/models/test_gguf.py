"""GGUFCheckpoint: config, metadata and weights of the real default model, and clear errors on bad files."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from rtxcore.errors import ModelLoadError
from rtxcore.models.config import RopeScaling
from rtxcore.models.gguf import (
    GGUFCheckpoint,
    GGUFSource,
    infer_llama3_rope_scaling,
    llama3_rope_factors,
)


@pytest.fixture(scope="module")
def checkpoint(default_model_file: Path) -> GGUFCheckpoint:
    return GGUFCheckpoint(default_model_file)


# -- the default model ---------------------------------------------------------------------------------------


def test_config_of_default_model(checkpoint: GGUFCheckpoint) -> None:
    c = checkpoint.model_config()
    assert checkpoint.architecture == "llama"
    assert (c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim) == (30, 576, 9, 3, 64)
    assert (c.vocab_size, c.intermediate_size, c.max_position) == (49152, 1536, 8192)
    assert c.rope_theta == 100000.0
    assert c.rms_norm_eps == pytest.approx(1e-5)
    assert c.tie_word_embeddings and c.rope_scaling is None and not c.attention_bias
    assert (c.bos_token_id, c.eos_token_ids) == (1, [2])
    assert c.name == "Smollm2 135M 8k Lc100K Mix1 Ep2"


def test_metadata_is_plain_python(checkpoint: GGUFCheckpoint) -> None:
    meta = checkpoint.metadata
    assert meta["general.architecture"] == "llama"
    assert meta["llama.block_count"] == 30
    assert meta["tokenizer.ggml.tokens"][:3] == ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    assert len(meta["tokenizer.ggml.merges"]) == 48900
    assert "<|im_start|>" in meta["tokenizer.chat_template"]
    summary = checkpoint.metadata_summary()
    assert summary["tokenizer.ggml.tokens"] == "<49152 items>"
    assert summary["general.languages"] == ["en"]  # short arrays stay
    assert len(repr(summary)) < 5000


def test_tensor_count(checkpoint: GGUFCheckpoint) -> None:
    # 30 layers x 9 tensors, embeddings and final norm; no lm_head (tied).
    assert checkpoint.num_tensors == len(checkpoint.tensor_names) == 272


@pytest.mark.model
@pytest.mark.hf
def test_weights_equal_transformers(checkpoint: GGUFCheckpoint, default_model_file: Path) -> None:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(default_model_file.parent, gguf_file=default_model_file.name,
                                                 dtype=torch.float32)
    reference = model.state_dict()
    calls: list[tuple[int, int]] = []
    ours = dict(checkpoint.weights(progress=lambda done, total: calls.append((done, total))))

    assert calls == [(i, 272) for i in range(1, 273)]
    assert "lm_head.weight" not in ours  # tied: HF's lm_head is the embedding
    assert set(reference) == set(ours) | {"lm_head.weight"}
    assert torch.equal(reference["lm_head.weight"], ours["model.embed_tokens.weight"])
    for name, tensor in ours.items():
        assert tensor.dtype == torch.float32 and tensor.is_contiguous(), name
        assert torch.equal(tensor, reference[name]), f"{name} differs from transformers"

    hf = model.config
    c = checkpoint.model_config()
    assert (c.num_layers, c.num_heads, c.num_kv_heads, c.head_dim) == (
        hf.num_hidden_layers, hf.num_attention_heads, hf.num_key_value_heads, hf.head_dim)
    assert (c.vocab_size, c.intermediate_size, c.rms_norm_eps) == (hf.vocab_size, hf.intermediate_size,
                                                                   hf.rms_norm_eps)


# -- synthetic files -----------------------------------------------------------------------------------------

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, FFN, VOCAB = 16, 4, 2, 4, 24, 32


def _llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf ``LlamaModel.permute``, which the loader must undo."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _write_gguf(path: Path, arch: str, tensors: dict[str, np.ndarray], rope_theta: float = 10000.0,
                **extra_kv: object) -> None:
    writer = gguf.GGUFWriter(path, arch)
    writer.add_name("tiny")
    writer.add_block_count(1)
    writer.add_context_length(128)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_rope_freq_base(rope_theta)
    writer.add_layer_norm_rms_eps(1e-6)
    for key, value in extra_kv.items():
        if isinstance(value, str):
            writer.add_string(key, value)
        else:
            writer.add_float32(key, float(value))
    for name, value in tensors.items():
        writer.add_tensor(name, value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _hf_weights(rng: np.random.Generator, bias: bool) -> dict[str, np.ndarray]:
    def r(*shape: int) -> np.ndarray:
        return rng.standard_normal(shape).astype(np.float32)

    w = {
        "model.embed_tokens.weight": r(VOCAB, HIDDEN),
        "model.layers.0.self_attn.q_proj.weight": r(HEADS * HEAD_DIM, HIDDEN),
        "model.layers.0.self_attn.k_proj.weight": r(KV_HEADS * HEAD_DIM, HIDDEN),
        "model.layers.0.self_attn.v_proj.weight": r(KV_HEADS * HEAD_DIM, HIDDEN),
        "model.layers.0.self_attn.o_proj.weight": r(HIDDEN, HEADS * HEAD_DIM),
        "model.layers.0.mlp.gate_proj.weight": r(FFN, HIDDEN),
        "model.layers.0.mlp.up_proj.weight": r(FFN, HIDDEN),
        "model.layers.0.mlp.down_proj.weight": r(HIDDEN, FFN),
        "model.layers.0.input_layernorm.weight": r(HIDDEN),
        "model.layers.0.post_attention_layernorm.weight": r(HIDDEN),
        "model.norm.weight": r(HIDDEN),
        "lm_head.weight": r(VOCAB, HIDDEN),
    }
    if bias:
        for proj, rows in (("q", HEADS), ("k", KV_HEADS), ("v", KV_HEADS)):
            w[f"model.layers.0.self_attn.{proj}_proj.bias"] = r(rows * HEAD_DIM)
    return w


_TO_GGUF = {
    "model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output",
    "model.layers.0.self_attn.q_proj": "blk.0.attn_q", "model.layers.0.self_attn.k_proj": "blk.0.attn_k",
    "model.layers.0.self_attn.v_proj": "blk.0.attn_v", "model.layers.0.self_attn.o_proj": "blk.0.attn_output",
    "model.layers.0.mlp.gate_proj": "blk.0.ffn_gate", "model.layers.0.mlp.up_proj": "blk.0.ffn_up",
    "model.layers.0.mlp.down_proj": "blk.0.ffn_down", "model.layers.0.input_layernorm": "blk.0.attn_norm",
    "model.layers.0.post_attention_layernorm": "blk.0.ffn_norm",
}


def _as_gguf(hf: dict[str, np.ndarray], permute: bool) -> dict[str, np.ndarray]:
    out = {}
    for name, value in hf.items():
        stem, suffix = name.rsplit(".", 1)
        gguf_name = f"{_TO_GGUF[stem]}.{suffix}"
        if permute and gguf_name.startswith("blk.0.attn_q."):
            value = _llama_cpp_permute(value, HEADS)
        elif permute and gguf_name.startswith("blk.0.attn_k."):
            value = _llama_cpp_permute(value, KV_HEADS)
        out[gguf_name] = value
    return out


@pytest.mark.parametrize("arch, bias", [("llama", False), ("llama", True), ("qwen2", True)])
def test_synthetic_weights_round_trip(tmp_path: Path, arch: str, bias: bool) -> None:
    """Q/K rows come back in HF order: un-permuted for llama, untouched for qwen2 (which llama.cpp never permutes)."""
    hf = _hf_weights(np.random.default_rng(0), bias)
    path = tmp_path / "tiny.gguf"
    _write_gguf(path, arch, _as_gguf(hf, permute=arch == "llama"))
    ckpt = GGUFCheckpoint(path)
    config = ckpt.model_config()
    assert not config.tie_word_embeddings and config.attention_bias == bias
    assert config.head_dim == HEAD_DIM and config.vocab_size == VOCAB
    got = dict(ckpt.weights())
    assert set(got) == set(hf)
    for name, value in hf.items():
        assert torch.equal(got[name], torch.from_numpy(value)), name


def test_source_adapter(tmp_path: Path) -> None:
    hf = _hf_weights(np.random.default_rng(1), bias=False)
    path = tmp_path / "tiny.gguf"
    _write_gguf(path, "llama", _as_gguf(hf, permute=True))
    assert GGUFSource.matches(path) and GGUFSource.matches(tmp_path)
    source = GGUFSource(tmp_path)
    assert source.name == "tiny" and source.config.name == "tiny" and source.num_weights() == len(hf)
    weights = dict(source.weights(dtype=torch.bfloat16))
    assert weights["model.norm.weight"].dtype == torch.bfloat16


def test_linear_rope_scaling(tmp_path: Path) -> None:
    path = tmp_path / "linear.gguf"
    _write_gguf(path, "llama", _as_gguf(_hf_weights(np.random.default_rng(2), False), permute=True),
                **{"llama.rope.scaling.type": "linear", "llama.rope.scaling.factor": 4.0})
    scaling = GGUFCheckpoint(path).model_config().rope_scaling
    assert scaling is not None and (scaling.kind, scaling.factor) == ("linear", 4.0)


@pytest.mark.parametrize("factor", [8.0, 32.0])
def test_llama3_rope_scaling_recovered_from_rope_freqs(tmp_path: Path, factor: float) -> None:
    # Llama 3.1 (factor 8) and 3.2 (factor 32) shapes: head_dim 128, theta 500000.
    expected = RopeScaling(kind="llama3", factor=factor)
    factors = llama3_rope_factors(expected, 500000.0, 128)
    assert infer_llama3_rope_scaling(factors, 500000.0, 128) == expected
    with pytest.raises(ModelLoadError, match="rope_freqs"):
        infer_llama3_rope_scaling(factors * 1.1, 500000.0, 128)

    tensors = _as_gguf(_hf_weights(np.random.default_rng(3), False), permute=True)
    # A theta this large puts the tiny model's lowest frequency past the original context, where `factor` shows.
    tensors["rope_freqs.weight"] = llama3_rope_factors(expected, 1e7, HEAD_DIM)
    path = tmp_path / "llama3.gguf"
    _write_gguf(path, "llama", tensors, rope_theta=1e7)
    ckpt = GGUFCheckpoint(path)
    assert ckpt.model_config().rope_scaling == expected
    assert "rope_freqs.weight" not in dict(ckpt.weights())  # consumed by the config, not a parameter


# -- bad files -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("num_bytes", [1_000_000, 50_000_000])
def test_truncated_file(tmp_path: Path, default_model_file: Path, num_bytes: int) -> None:
    path = tmp_path / "cut.gguf"
    with default_model_file.open("rb") as src:
        path.write_bytes(src.read(num_bytes))
    with pytest.raises(ModelLoadError, match="truncated") as info:
        GGUFCheckpoint(path)
    message = str(info.value)
    assert str(path) in message and "\n" not in message


def test_tensor_data_cut_short(tmp_path: Path) -> None:
    path = tmp_path / "short.gguf"
    _write_gguf(path, "llama", _as_gguf(_hf_weights(np.random.default_rng(4), False), permute=True))
    path.write_bytes(path.read_bytes()[:-100])
    with pytest.raises(ModelLoadError, match="truncated"):
        GGUFCheckpoint(path)


def test_text_file_is_not_gguf(tmp_path: Path) -> None:
    path = tmp_path / "notes.gguf"
    path.write_text("just some text\n")
    with pytest.raises(ModelLoadError, match="not a GGUF file") as info:
        GGUFCheckpoint(path)
    assert str(path) in str(info.value)


def test_empty_file(tmp_path: Path) -> None:
    path = tmp_path / "empty.gguf"
    path.touch()
    with pytest.raises(ModelLoadError, match="empty"):
        GGUFCheckpoint(path)


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="no such file"):
        GGUFCheckpoint(tmp_path / "absent.gguf")


def test_directory(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="not a regular file"):
        GGUFCheckpoint(tmp_path)


def test_unsupported_architecture(tmp_path: Path) -> None:
    path = tmp_path / "bert.gguf"
    _write_gguf(path, "bert", {"token_embd.weight": np.zeros((VOCAB, HIDDEN), np.float32)})
    with pytest.raises(ModelLoadError, match=r"architecture 'bert' is not supported"):
        GGUFCheckpoint(path)


def test_unknown_tensor(tmp_path: Path) -> None:
    tensors = _as_gguf(_hf_weights(np.random.default_rng(5), False), permute=True)
    tensors["blk.0.mystery.weight"] = np.zeros(4, np.float32)
    path = tmp_path / "odd.gguf"
    _write_gguf(path, "llama", tensors)
    with pytest.raises(ModelLoadError, match="blk.0.mystery.weight"):
        GGUFCheckpoint(path)


def test_file_without_tokenizer(tmp_path: Path) -> None:
    path = tmp_path / "notok.gguf"
    _write_gguf(path, "llama", _as_gguf(_hf_weights(np.random.default_rng(6), False), permute=True))
    with pytest.raises(ModelLoadError, match="has no tokenizer") as info:
        GGUFCheckpoint(path).tokenizer()
    assert str(path) in str(info.value)
