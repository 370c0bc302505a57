"""``rtx quantize`` on the real default model: a checkpoint ``rtx serve`` loads, per-layer errors with automatic
fallback, and bad input refused without leaving anything half-written."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch

from rtxcore.contracts.backend import BackendOptions
from rtxcore.models.resolve import resolve_model
from rtxcore.quant.evaluation import prefill_logits
from rtxcore.quant.pipeline import QuantizeOptions, evaluation_tokens, quantize_model
from rtxcore.registry import load_plugins
from tests.helpers.cli import RTX, assert_one_line_error, rtx

pytestmark = pytest.mark.model

# Small enough for CI on two cores; the figures in docs/benchmarks.md use the defaults.
FAST = ["--calibration-tokens", "1024", "--eval-tokens", "512"]


def quantize(out: Path, method: str, *extra: str):
    return rtx("quantize", "smollm2-135m", "--method", method, "--out", str(out), *FAST, *extra, "--json")


@pytest.fixture(scope="module")
def int8_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("q") / "int8"
    proc = quantize(out, "int8")
    assert proc.returncode == 0, proc.stderr
    return out


def _torch_backend(model: str, quantizers=None):
    registry = load_plugins()
    source = resolve_model(model)
    backend = registry.get("backend", "torch").cls(BackendOptions("cpu", "float32", max_model_len=512, quantizers={
        m: registry.create("quantizer", m) for m in source.quantization_methods()}))
    backend.load(source)
    backend.allocate_kv_cache(40, 16)
    return backend


def test_int8_checkpoint_layout_and_quality(int8_dir):
    config = json.loads((int8_dir / "config.json").read_text())
    qc = config["quantization_config"]
    assert qc["quant_method"] == "rtx-serve" and qc["format"] == "int-quantized"
    layers = qc["rtx"]["layers"]
    # Every decoder linear layer: 30 layers x (q, k, v, o, gate, up, down).
    assert len(layers) == 30 * 7 and {v["method"] for v in layers.values()} == {"int8"}
    assert {"tokenizer.json", "model.safetensors", "quantization_report.json"} <= {p.name for p in int8_dir.iterdir()}
    report = json.loads((int8_dir / "quantization_report.json").read_text())
    row = report["layers"][0]
    assert row["relative_error"] > 0 and row["snr_db"] > 20
    # The bar, on held-out text: within 0.5 perplexity of the float model.
    evaluation = report["evaluation"]
    assert 0 <= evaluation["ppl_increase"] < 0.5, evaluation
    # int8 linear layers and bf16 for the rest, against the whole model in bf16.
    assert report["bytes"]["quantized"] < 0.7 * resolve_model(None).config.num_params * 2


def test_int8_checkpoint_runs_from_its_stored_form(int8_dir):
    quantized = _torch_backend(str(int8_dir))
    layer = quantized.model.layers[0].self_attn.qkv_proj
    assert layer.quantized.qtensor.method == "int8" and layer.weight.numel() == 0
    assert layer.quantized.qtensor.tensors["weight"].dtype == torch.int8
    reference = _torch_backend("smollm2-135m")
    ids = evaluation_tokens(resolve_model(None), 256)
    agree = (prefill_logits(quantized, ids).argmax(-1) == prefill_logits(reference, ids).argmax(-1)).float().mean()
    assert agree > 0.9, agree


def test_serve_loads_the_quantized_checkpoint(int8_dir):
    import httpx

    from tests.helpers.server import start_server

    with start_server("--model", str(int8_dir), "--no-grpc") as server:
        models = httpx.get(f"{server.base_url}/v1/models").json()
        assert models["data"][0]["id"] == "int8"
        reply = httpx.post(f"{server.base_url}/v1/completions", json={
            "model": "int8", "prompt": "The capital of France is", "max_tokens": 8, "temperature": 0}, timeout=60)
        assert reply.status_code == 200, reply.text
        assert reply.json()["choices"][0]["text"].strip()


def test_tight_budget_falls_back_and_names_the_layers(tmp_path):
    budget = 0.08
    out = tmp_path / "int4"
    proc = quantize(out, "int4", "--max-layer-error", str(budget))
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert "layers: 210/210 (100%)" in proc.stderr  # progress, as whole lines when stderr is not a terminal
    layers = json.loads((out / "config.json").read_text())["quantization_config"]["rtx"]["layers"]
    fell_back = {name for fb in report["fallbacks"] for name in fb["layers"]}
    assert fell_back and len(fell_back) < len(report["layers"]), "the budget should split the layers"
    for fb in report["fallbacks"]:
        first = fb["attempts"][0]
        assert first["method"] == "int4" and first["over_budget"]
        assert all(first["relative_errors"][n] > budget for n in first["over_budget"])
        for name in fb["layers"]:
            assert name.removeprefix("model.").removesuffix(".weight") in proc.stderr
            assert (layers[name]["method"] if name in layers else None) == fb["to"]
    for row in report["layers"]:
        if row["name"] not in fell_back:
            assert row["method"] == "int4" and row["relative_error"] <= budget
    # Loaded back with int4 and int8 layers side by side (fused q|k|v with zero points): still a working model.
    assert 0 < report["evaluation"]["ppl_increase"] < 8.0, report["evaluation"]


def test_a_calibration_file_of_ones_own_calibrates_and_one_too_short_to_plan_on_is_refused(tmp_path, int8_dir):
    from rtxcore.quant.calibration import calibration_text

    # The built-in text's paragraphs in reverse order: other statistics, so other per-layer errors.
    own = tmp_path / "own.txt"
    own.write_text("\n\n".join(reversed(calibration_text().split("\n\n"))), encoding="utf-8")
    out = tmp_path / "own-int8"
    proc = quantize(out, "int8", "--calibration-file", str(own))
    assert proc.returncode == 0, proc.stderr
    builtin = json.loads((int8_dir / "quantization_report.json").read_text())["layers"]
    mine = json.loads(proc.stdout)["layers"]
    assert [r["name"] for r in mine] == [r["name"] for r in builtin]
    assert sum(r["relative_error"] != b["relative_error"] for r, b in zip(mine, builtin)) > len(mine) // 2
    # Enough for calibration's 1024 tokens but not for two planning pieces after them.
    short = tmp_path / "short.txt"
    short.write_text(calibration_text()[:6000], encoding="utf-8")
    proc = quantize(tmp_path / "short-plan", "int4", "--plan", "--calibration-file", str(short))
    assert_one_line_error(proc, "the calibration text is too short to keep planning text apart from calibration")
    assert not (tmp_path / "short-plan").exists()


def test_impossible_budget_keeps_every_layer_in_float(tmp_path):
    out = tmp_path / "none"
    proc = quantize(out, "int8", "--max-layer-error", "1e-9", "--eval-tokens", "0")
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert all(row["method"] is None for row in report["layers"])
    assert "unquantized" in report["fallbacks"][0]["reason"]


@pytest.mark.parametrize("args, fragment", [
    (["--method", "int3"], "unknown quantization method 'int3'"),
    (["--method", "int8", "--max-layer-error", "-1"], "--max-layer-error must be positive"),
    (["--method", "int8", "--eval-tokens", "1"], "--eval-tokens must be 0 (skip) or at least 2"),
    (["--method", "int8", "--device", "gpu"], "--device must be cpu, cuda or cuda:N"),
    (["--method", "int4", "--plan", "--plan-confidence", "1"], "--plan-confidence must be at least 0.5 and below 1"),
    (["--method", "int4", "--plan", "--planning-tokens", "300"], "--planning-tokens must be at least 512"),
])
def test_bad_arguments(tmp_path, args, fragment):
    out = tmp_path / "out"
    proc = rtx("quantize", "smollm2-135m", "--out", str(out), *args)
    assert_one_line_error(proc, fragment)
    assert not out.exists()


def test_model_without_weights(tmp_path):
    model = tmp_path / "empty-model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(resolve_model("dummy:tiny").config.to_hf()))
    proc = rtx("quantize", str(model), "--method", "int8", "--out", str(tmp_path / "out"))
    assert_one_line_error(proc, "no *.safetensors weight files")
    assert not (tmp_path / "out").exists()


def test_model_without_tokenizer(tmp_path):
    proc = rtx("quantize", "dummy:tiny", "--method", "int8", "--out", str(tmp_path / "out"))
    assert_one_line_error(proc, "has no tokenizer")


def test_out_parent_must_be_writable(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    proc = rtx("quantize", "smollm2-135m", "--method", "int8", "--out", str(blocker / "out"))
    assert_one_line_error(proc, "is not an existing directory")


def test_out_must_be_new(tmp_path):
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "keep.txt").write_text("mine")
    proc = rtx("quantize", "smollm2-135m", "--method", "int8", "--out", str(tmp_path / "taken"))
    assert_one_line_error(proc, "already exists")
    assert [p.name for p in (tmp_path / "taken").iterdir()] == ["keep.txt"]


def test_out_must_not_be_a_link(tmp_path):
    (tmp_path / "target").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "target")
    proc = rtx("quantize", "smollm2-135m", "--method", "int8", "--out", str(tmp_path / "link"))
    assert_one_line_error(proc, "is a symbolic link")


def test_checkpoint_files_are_readable_by_a_server_of_another_user(int8_dir):
    umask = os.umask(0)
    os.umask(umask)  # the test process's umask is the one rtx quantize ran with
    if umask & 0o044:
        pytest.skip(f"umask {umask:03o} hides files from other users anyway")
    modes = {path.name: path.stat().st_mode & 0o777 for path in int8_dir.iterdir() if path.is_file()}
    assert modes and all(mode == 0o666 & ~umask for mode in modes.values()), modes


def test_sigterm_midway_leaves_nothing(tmp_path):
    """SIGTERM while the staged checkpoint is written and evaluated: it is removed, as on Ctrl-C."""
    out = tmp_path / "out"
    # Short calibration: what is tested is the staged directory's removal, not the calibration before it.
    proc = subprocess.Popen([RTX, "quantize", "smollm2-135m", "--method", "int8", "--out", str(out), *FAST],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 300
        while not list(tmp_path.glob(".out.*.partial")) and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.02)
        assert proc.poll() is None, "quantize ended before its checkpoint was staged"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 130
    finally:
        proc.kill()
    assert list(tmp_path.iterdir()) == []


def _small_model(directory: Path, hidden: int, intermediate: int, num_layers: int = 1, num_heads: int = 5,
                 num_kv_heads: int = 5) -> Path:
    """A random-weight model of the default one's architecture and tokenizer, small enough to quantize at once."""
    from safetensors.torch import save_file

    default = resolve_model(None)
    directory.mkdir()
    config = default.config.to_hf() | {
        "hidden_size": hidden, "num_hidden_layers": num_layers, "num_attention_heads": num_heads,
        "num_key_value_heads": num_kv_heads, "head_dim": hidden // num_heads, "intermediate_size": intermediate}
    (directory / "config.json").write_text(json.dumps(config))
    default.tokenizer().save(directory)
    gen = torch.Generator().manual_seed(0)
    kv = num_kv_heads * hidden // num_heads
    shapes = {"model.embed_tokens.weight": (config["vocab_size"], hidden), "model.norm.weight": (hidden,)}
    for i in range(num_layers):
        layer = f"model.layers.{i}"
        shapes |= {f"{layer}.input_layernorm.weight": (hidden,), f"{layer}.post_attention_layernorm.weight": (hidden,)}
        for proj, shape in {"q": (hidden, hidden), "k": (kv, hidden), "v": (kv, hidden), "o": (hidden, hidden)}.items():
            shapes[f"{layer}.self_attn.{proj}_proj.weight"] = shape
        for proj, shape in {"gate": (intermediate, hidden), "up": (intermediate, hidden),
                            "down": (hidden, intermediate)}.items():
            shapes[f"{layer}.mlp.{proj}_proj.weight"] = shape
    save_file({k: torch.randn(s, generator=gen) * 0.05 for k, s in shapes.items()},
              str(directory / "model.safetensors"))
    return directory


def test_failure_midway_leaves_nothing(tmp_path):
    """A model int4 cannot group (40 input features) fails after calibration: no --out, no partial directory."""
    model = _small_model(tmp_path / "odd", hidden=40, intermediate=96)
    out = tmp_path / "out"
    proc = rtx("quantize", str(model), "--method", "int4", "--out", str(out), *FAST)
    assert_one_line_error(proc, "cannot be split into groups", after_progress=True)
    assert not out.exists()
    assert not [p for p in tmp_path.iterdir() if "partial" in p.name]


def test_progress_is_reported_once_per_group_of_fused_layers(tmp_path, registry):
    model = _small_model(tmp_path / "small", hidden=64, intermediate=128, num_layers=2, num_heads=4, num_kv_heads=2)
    calls: list[tuple[int, int]] = []
    options = QuantizeOptions("int8", tmp_path / "out", calibration_tokens=512, eval_tokens=0)
    report = quantize_model(str(model), options, registry, progress=lambda done, total: calls.append((done, total)))
    # The start, then per layer: q|k|v, o, gate|up and down, counted in linear layers.
    assert calls == [(0, 14), (3, 14), (4, 14), (6, 14), (7, 14), (10, 14), (11, 14), (13, 14), (14, 14)]
    assert len(report["layers"]) == 14


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def test_damaged_checkpoint_is_refused(int8_dir, tmp_path):
    damaged = _copy(int8_dir, tmp_path / "damaged")
    weights = damaged / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[len(data) // 2] ^= 0xFF
    weights.write_bytes(bytes(data))
    proc = rtx("generate", "hi", "--model", str(damaged), "--max-tokens", "2")
    assert_one_line_error(proc, "damaged quantized checkpoint")


def test_checkpoint_missing_a_tensor_is_refused(int8_dir, tmp_path):
    broken = _copy(int8_dir, tmp_path / "broken")
    config = json.loads((broken / "config.json").read_text())
    layer = next(iter(config["quantization_config"]["rtx"]["layers"].values()))
    layer["tensors"].append("weight_extra")
    (broken / "config.json").write_text(json.dumps(config))
    proc = rtx("generate", "hi", "--model", str(broken), "--max-tokens", "2")
    assert_one_line_error(proc, "lacks its tensor")


@pytest.mark.parametrize("edit, message", [
    (lambda layer: layer.pop("method"), "malformed entry (no method)"),
    (lambda layer: layer.update(meta=None), "meta None is not a table"),
])
def test_checkpoint_with_an_edited_layer_entry_is_refused(int8_dir, tmp_path, edit, message):
    broken = _copy(int8_dir, tmp_path / "broken")
    config = json.loads((broken / "config.json").read_text())
    edit(next(iter(config["quantization_config"]["rtx"]["layers"].values())))
    (broken / "config.json").write_text(json.dumps(config))
    proc = rtx("generate", "hi", "--model", str(broken), "--max-tokens", "2")
    assert_one_line_error(proc, message)


def test_truncated_checkpoint_is_refused(int8_dir, tmp_path):
    truncated = _copy(int8_dir, tmp_path / "truncated")
    weights = truncated / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    proc = rtx("generate", "hi", "--model", str(truncated), "--max-tokens", "2")
    assert_one_line_error(proc, "corrupt safetensors file")


@pytest.mark.parametrize("method", ["int8", "int4", "fp8", "int8-sq"])
def test_quantized_at_load_runs_what_the_quantizer_describes(method):
    """``--quantization``: each fused layer is quantized whole and run through the quantizer's linear(); the result
    equals float weights replaced by their dequantized form (activation rounding aside, for fp8 and int8-sq)."""
    registry = load_plugins()
    quantizer = registry.create("quantizer", method)
    source = resolve_model("dummy:tiny")
    backend_cls = registry.get("backend", "torch").cls
    quantized = backend_cls(BackendOptions("cpu", "float32", quantizer, max_model_len=64))
    quantized.load(source)
    assert all(layer.quantized is not None for layer in quantized.model.linear_layers().values())
    assert quantized.weight_bytes() < 0.8 * sum(p.numel() * 4 for _, p in [*source.weights()])
    approx = backend_cls(BackendOptions("cpu", "float32", max_model_len=64))
    approx.load(source)
    for name, layer in approx.model.linear_layers().items():
        qt = quantized.model.get_submodule(name).quantized.qtensor
        layer.weight.data.copy_(quantizer.dequantize(qt))
    for backend in (quantized, approx):
        backend.allocate_kv_cache(8, 16)
    ids = list(range(3, 40))
    got, want = prefill_logits(quantized, ids), prefill_logits(approx, ids)
    tolerance = 0.1 if method in ("fp8", "int8-sq") else 1e-4  # those round activations too
    assert ((got - want).norm() / want.norm()).item() < tolerance


def test_calibrations_given_are_reused_where_the_same_and_made_where_not(tmp_path, monkeypatch):
    from rtxcore.quant import pipeline

    made = []
    calibrate = pipeline._calibrate
    monkeypatch.setattr(pipeline, "_calibrate", lambda *a, **kw: made.append(a[2].method) or calibrate(*a, **kw))
    registry, calibrations = load_plugins(), {}
    # int4 and int8 need the same float statistics; a different calibration length does not share them.
    for method, tokens in (("int4", 512), ("int8", 512), ("int8", 1024)):
        options = QuantizeOptions(method, tmp_path / f"{method}-{tokens}", calibration_tokens=tokens, eval_tokens=0)
        report = quantize_model(None, options, registry, calibrations=calibrations)
        assert report["calibration"]["tokens"] == tokens
    assert made == ["int4", "int8"] and len(calibrations) == 2
