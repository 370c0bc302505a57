"""Signed models: `rtx sign` / `rtx verify` (OpenSSF model signing, EC keys made here, offline) and the check
`rtx serve` makes before loading a model (`--signing-public-key`, `--require-signed-models`)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa

from rtxcore.provenance.signing import SignatureError, sign_model, verify_model
from tests.helpers.server import RTX, start_server

pytestmark = pytest.mark.model


def write_key_pair(directory: Path, name: str) -> tuple[Path, Path]:
    key = ec.generate_private_key(ec.SECP256R1())
    private, public = directory / f"{name}.pem", directory / f"{name}.pub"
    private.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                          serialization.NoEncryption()))
    public.write_bytes(key.public_key().public_bytes(serialization.Encoding.PEM,
                                                     serialization.PublicFormat.SubjectPublicKeyInfo))
    return private, public


@pytest.fixture(scope="module")
def keys(tmp_path_factory) -> tuple[Path, Path]:
    return write_key_pair(tmp_path_factory.mktemp("keys"), "signer")


@pytest.fixture(scope="module")
def model_copy(tmp_path_factory, default_model_file) -> Path:
    """An unsigned copy of the default model's GGUF file; tests copy it again before changing it."""
    path = tmp_path_factory.mktemp("model") / default_model_file.name
    shutil.copyfile(default_model_file, path)
    return path


def rtx(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([RTX, *args], check=False, capture_output=True, text=True, timeout=timeout)


def serve_until_exit(*args: str) -> subprocess.CompletedProcess:
    """`rtx serve` on a model it must refuse: it exits by itself, before loading any weights."""
    return rtx("serve", "--host", "127.0.0.1", "--port", "0", "--no-grpc", *args)


def one_line_error(result: subprocess.CompletedProcess) -> str:
    assert result.returncode == 2, result.stdout + result.stderr
    lines = [line for line in result.stderr.splitlines() if line.startswith("rtx: error: ")]
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    return lines[0]


@pytest.fixture(scope="module")
def signed_model(tmp_path_factory, model_copy, keys) -> Path:
    path = tmp_path_factory.mktemp("signed") / model_copy.name
    shutil.copyfile(model_copy, path)
    result = rtx("sign", str(path), "--key", str(keys[0]))
    assert result.returncode == 0, result.stderr
    assert path.with_name(path.name + ".sig").is_file()
    return path


def test_sign_then_verify_on_the_command_line(signed_model, keys):
    result = rtx("verify", str(signed_model), "--key", str(keys[1]))
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith(f"verified {signed_model}")


def test_verify_refuses_another_signers_key(signed_model, tmp_path):
    _, other_public = write_key_pair(tmp_path, "other")
    error = one_line_error(rtx("verify", str(signed_model), "--key", str(other_public)))
    assert "Key mismatch" in error


@pytest.mark.parametrize("content", ["{}", "not json", '{"verificationMaterial": 5}'])
def test_a_signature_file_that_is_no_bundle_is_named(signed_model, keys, tmp_path, content):
    # It used to read "signature check failed for model ...: 'verificationMaterial'" (a KeyError's text).
    bad = tmp_path / "bad.sig"
    bad.write_text(content)
    error = one_line_error(rtx("verify", str(signed_model), "--key", str(keys[1]), "--signature", str(bad)))
    assert f"{bad} is not a model-signing bundle" in error, error


def test_signed_default_model_loads_in_strict_mode(signed_model, keys):
    with start_server("--model", str(signed_model), "--no-grpc", "--num-kv-blocks", "64",
                      "--signing-public-key", str(keys[1]), "--require-signed-models") as server:
        server.wait_ready()
    assert "is not signed" not in server.stderr


def test_one_changed_byte_is_refused(signed_model, keys, tmp_path):
    tampered = tmp_path / signed_model.name
    shutil.copyfile(signed_model, tampered)
    shutil.copyfile(signed_model.with_name(signed_model.name + ".sig"), tampered.with_name(tampered.name + ".sig"))
    with tampered.open("r+b") as f:  # one byte in the middle of the tensor data
        f.seek(tampered.stat().st_size // 2)
        byte = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([byte[0] ^ 0x01]))
    for strict in (["--require-signed-models"], []):  # a signature that is present must match, strict or not
        error = one_line_error(serve_until_exit("--model", str(tampered), "--signing-public-key", str(keys[1]),
                                                *strict))
        assert f"signature check failed for model {tampered}: contents differ from what was signed" in error
    error = one_line_error(rtx("verify", str(tampered), "--key", str(keys[1])))
    assert "contents differ from what was signed" in error


def test_unsigned_model_is_refused_in_strict_mode(model_copy, keys):
    error = one_line_error(serve_until_exit("--model", str(model_copy), "--signing-public-key", str(keys[1]),
                                            "--require-signed-models"))
    assert f"model {model_copy} is not signed: no signature at {model_copy}.sig" in error


def test_unsigned_model_loads_with_a_warning_when_not_strict(model_copy, keys):
    with start_server("--model", str(model_copy), "--no-grpc", "--num-kv-blocks", "64",
                      "--signing-public-key", str(keys[1])) as server:
        server.wait_ready()
    assert f"model {model_copy} is not signed" in server.stderr
    assert "WARNING rtx.provenance" in server.stderr


def test_strict_mode_needs_a_key_and_cannot_take_random_weights(keys):
    error = one_line_error(serve_until_exit("--model", "dummy:tiny", "--require-signed-models"))
    assert "needs a public key" in error
    error = one_line_error(serve_until_exit("--model", "dummy:tiny", "--require-signed-models",
                                            "--signing-public-key", str(keys[1])))
    assert "random weights (dummy:) cannot be signed" in error


def test_keys_that_are_not_ec_pem_are_named_before_any_work(signed_model, model_copy, tmp_path):
    # model-signing fails on an RSA key with an AttributeError of its own; a file that is no key at all used to
    # start a server that only warned "not signed", as if it checked signatures.
    rsa_key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    rsa_private, rsa_public, garbage = tmp_path / "rsa.pem", tmp_path / "rsa.pub", tmp_path / "garbage.pem"
    rsa_private.write_bytes(rsa_key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                                  serialization.NoEncryption()))
    rsa_public.write_bytes(rsa_key.public_key().public_bytes(serialization.Encoding.PEM,
                                                             serialization.PublicFormat.SubjectPublicKeyInfo))
    garbage.write_text("not a key\n")
    assert "key of type RSA" in one_line_error(rtx("sign", str(model_copy), "--key", str(rsa_private)))
    assert "key of type RSA" in one_line_error(rtx("verify", str(signed_model), "--key", str(rsa_public)))
    assert "is a directory" in one_line_error(rtx("sign", str(model_copy), "--key", str(tmp_path)))
    for key in (garbage, rsa_public):
        error = one_line_error(serve_until_exit("--model", str(model_copy), "--signing-public-key", str(key)))
        assert f"signing public key {key}" in error
    assert not (model_copy.parent / (model_copy.name + ".sig")).exists()


def test_a_signature_never_overwrites_the_model_or_the_key_and_an_empty_directory_is_not_signed(tmp_path, keys):
    private, _ = keys
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF and more")
    assert "would overwrite the model" in one_line_error(rtx("sign", str(model), "--key", str(private),
                                                             "--signature", str(model)))
    assert model.read_bytes() == b"GGUF and more"
    assert "would overwrite the private key" in one_line_error(rtx("sign", str(model), "--key", str(private),
                                                                   "--signature", str(private)))
    empty = tmp_path / "empty"
    empty.mkdir()
    assert "holds no files" in one_line_error(rtx("sign", str(empty), "--key", str(private)))


def test_a_signed_directory_covers_every_file(tmp_path, keys):
    """Hugging Face directories and ONNX exports are signed as directories: an added, removed or changed file fails."""
    model = tmp_path / "export"
    model.mkdir()
    (model / "config.json").write_text('{"architectures": ["LlamaForCausalLM"]}')
    (model / "model.onnx").write_bytes(bytes(range(256)) * 64)
    (model / "model.onnx.data").write_bytes(b"\0" * 4096)
    signature = sign_model(model, keys[0])
    assert signature == model / "model.sig"
    verify_model(model, keys[1])

    (model / "extra.bin").write_bytes(b"x")
    with pytest.raises(SignatureError, match="Extra files found"):
        verify_model(model, keys[1])
    (model / "extra.bin").unlink()
    (model / "model.onnx.data").write_bytes(b"\0" * 4095 + b"\1")
    with pytest.raises(SignatureError, match=r"contents differ from what was signed \(model.onnx.data\)"):
        verify_model(model, keys[1])
    (model / "model.onnx.data").unlink()
    with pytest.raises(SignatureError, match="Missing files"):
        verify_model(model, keys[1])


def test_cached_onnx_exports_are_reused_only_when_signed(tmp_path, keys):
    """With signed models required, an export kept on disk is reused only with a valid signature: unsigned or
    changed, it is rebuilt from the (verified) weights instead of run."""
    from functools import partial

    from rtx_plugins.backends.graph_runtime.cache import GraphCache
    from rtx_plugins.backends.graph_runtime.exporter import (
        ExportSettings,
        exported_graph,
    )
    from rtxcore.models.dummy import DummySource

    private, public = keys
    cache = GraphCache(tmp_path / "graphs", verify=partial(verify_model, public_key=public))
    first = exported_graph(DummySource("tiny"), ExportSettings(), cache)
    assert not first.cache_hit
    again = exported_graph(DummySource("tiny"), ExportSettings(), cache)
    assert not again.cache_hit  # unsigned: exported again rather than trusted
    entry = again.path.parent
    sign_model(entry, private)
    signed = exported_graph(DummySource("tiny"), ExportSettings(), cache)
    assert signed.cache_hit and signed.path == again.path
    tampered = bytearray(signed.path.read_bytes())
    tampered[len(tampered) // 2] ^= 0xFF
    signed.path.write_bytes(bytes(tampered))
    rebuilt = exported_graph(DummySource("tiny"), ExportSettings(), cache)
    assert not rebuilt.cache_hit and rebuilt.path.read_bytes() != bytes(tampered)
    # Without verification (no signing key configured) the cache is trusted as before.
    assert exported_graph(DummySource("tiny"), ExportSettings(), GraphCache(tmp_path / "graphs")).cache_hit
