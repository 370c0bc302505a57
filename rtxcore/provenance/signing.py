"""Sign and verify models with the OpenSSF ``model-signing`` library, offline, with an elliptic-curve key pair.

What is signed is what ``rtx serve --model`` reads: a single file (a GGUF checkpoint, quantized or not) or a whole
directory (Hugging Face weights, tokenizer and config, or an exported ONNX model with its external data). The
signature is a Sigstore bundle next to it: ``FILE.sig`` for a file, ``DIR/model.sig`` inside a directory (left out
of the directory's own manifest). Every file of a directory is covered, so an added, removed or changed file fails
verification as surely as a changed byte.

The policy at load time (:func:`check_model_signature`):

- no public key configured: nothing is checked (and ``require_signed_models`` is a configuration error);
- a public key configured: a signature that is present must verify, else the model is refused; a missing
  signature is refused when ``require_signed_models`` is on, and only warned about otherwise.
"""

from __future__ import annotations

import json
import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path

from rtxcore.errors import ConfigError, RtxError

log = logging.getLogger("rtx.provenance")

DIRECTORY_SIGNATURE = "model.sig"


class SignatureError(RtxError):
    """A model's signature is missing, unreadable or does not match its files."""


@dataclass(slots=True)
class SigningPolicy:
    # PEM public key models are verified against; None checks nothing.
    public_key: Path | None = None
    # Refuse models without a valid signature (needs public_key).
    require_signed_models: bool = False

    def __post_init__(self) -> None:
        if self.public_key is not None:
            self.public_key = Path(os.path.expanduser(self.public_key))
            if not self.public_key.is_file():
                raise ConfigError(f"signing public key not found: {self.public_key}")
            # Read now, not at the first signed model: a key that cannot verify anything would otherwise leave a
            # server that believes it checks signatures while it only warns that models are unsigned.
            problem = _ec_key_problem(self.public_key, private=False)
            if problem:
                raise ConfigError(f"signing public key {self.public_key} {problem}")
        if self.require_signed_models and self.public_key is None:
            raise ConfigError("require_signed_models needs a public key to verify with (--signing-public-key)")


def default_signature_path(model_path: str | Path) -> Path:
    path = Path(model_path)
    return path / DIRECTORY_SIGNATURE if path.is_dir() else path.with_name(path.name + ".sig")


def _model_signing():
    try:
        from model_signing import hashing, signing, verifying
    except ImportError:
        raise ConfigError("model signing needs the model-signing package: "
                          "pip install 'rtx-serve[provenance]'") from None
    return hashing, signing, verifying


def _hashing_config(hashing, model_path: Path, signature: Path):
    config = hashing.Config()
    if model_path.is_dir():
        # The signature cannot be part of what it signs. The library takes paths relative to the model directory
        # and records them in the manifest, so verification leaves the signature out too.
        try:
            inside = [signature.resolve().relative_to(model_path.resolve())]
        except ValueError:
            inside = []
        config.set_ignored_paths(paths=inside, ignore_git_paths=True)
    return config


def _check_model_path(model_path: str | Path) -> Path:
    path = Path(os.path.expanduser(model_path))
    if not path.exists():
        raise SignatureError(f"model not found: {path}")
    return path


def sign_model(model_path: str | Path, private_key: str | Path, signature: str | Path | None = None,
               password: str | None = None) -> Path:
    """Sign ``model_path`` (file or directory) with a PEM EC private key. :returns: the signature's path."""
    hashing, signing, _ = _model_signing()
    path = _check_model_path(model_path)
    key = Path(os.path.expanduser(private_key))
    if not key.is_file():
        raise ConfigError(f"private key {key} is a directory" if key.is_dir() else f"private key not found: {key}")
    problem = _ec_key_problem(key, private=True, password=password)
    if problem:
        raise ConfigError(f"cannot sign with {key}: it {problem}")
    sig = Path(signature) if signature else default_signature_path(path)
    # The signature is written over whatever is at its path: never the model or the key it would stand for.
    for what, other in (("the model", path), ("the private key", key)):
        if sig.resolve() == other.resolve():
            raise ConfigError(f"the signature would overwrite {what} ({other}): give --signature another path")
    if path.is_dir() and not any(f.is_file() and f.resolve() != sig.resolve() for f in path.rglob("*")):
        raise ConfigError(f"{path} holds no files to sign")
    try:
        (signing.Config().use_elliptic_key_signer(private_key=key, password=password)
         .set_hashing_config(_hashing_config(hashing, path, sig)).sign(path, sig))
    except (ValueError, TypeError) as exc:  # a key that is not a PEM EC private key, or a wrong password
        raise ConfigError(f"cannot sign with {key}: {_first_line(exc)}") from None
    except OSError as exc:  # the signature's place is not writable, or a model file went away
        raise ConfigError(f"cannot sign {path} into {sig}: {exc.strerror or exc}") from None
    return sig


def verify_model(model_path: str | Path, public_key: str | Path, signature: str | Path | None = None) -> Path:
    """Verify ``model_path`` against its signature and a PEM EC public key.

    :returns: the signature's path.
    :raises SignatureError: no signature, a signature by another key, or files that do not match it.
    """
    _, _, verifying = _model_signing()
    path = _check_model_path(model_path)
    sig = Path(signature) if signature else default_signature_path(path)
    if not sig.is_file():
        raise SignatureError(f"model {path} is not signed: no signature at {sig} (sign it with `rtx sign`)")
    problem = _ec_key_problem(Path(os.path.expanduser(public_key)), private=False)
    if problem:
        raise ConfigError(f"public key {public_key} {problem}")
    try:
        verifying.Config().use_elliptic_key_verifier(public_key=public_key).verify(path, sig)
    except Exception as exc:  # noqa: BLE001 -- the library raises ValueError, protobuf and cryptography errors alike
        if _unreadable_bundle(exc):
            raise SignatureError(f"signature check failed for model {path}: {sig} is not a model-signing bundle "
                                 f"({type(exc).__name__}: {_first_line(exc)})") from None
        raise SignatureError(f"signature check failed for model {path}: {_describe_failure(exc, path)}") from None
    return sig


def _unreadable_bundle(exc: BaseException) -> bool:
    """Whether the library failed reading the signature file itself: not JSON (a JSONDecodeError), JSON of
    another shape (a KeyError such as 'verificationMaterial', a TypeError), or not the bundle's protobuf schema."""
    return (isinstance(exc, (KeyError, TypeError, json.JSONDecodeError))
            or type(exc).__module__.startswith("google.protobuf"))


def check_model_signature(model_path: str, policy: SigningPolicy) -> None:
    """Apply ``policy`` to the model at ``model_path`` before it is loaded (see the module's docstring).

    ``model_path`` is "" for random weights, which have nothing to verify.
    """
    if policy.public_key is None:
        return
    if not model_path:
        if policy.require_signed_models:
            raise SignatureError("require_signed_models is on, but random weights (dummy:) cannot be signed")
        return
    sig = default_signature_path(model_path)
    if not sig.exists() and not policy.require_signed_models:
        log.warning("model %s is not signed (no %s); loading it because require_signed_models is off",
                    model_path, sig)
        return
    verify_model(model_path, policy.public_key, sig)
    log.info("model %s: signature %s verified", model_path, sig)


def _ec_key_problem(key: Path, private: bool, password: str | None = None) -> str | None:
    """What keeps ``key`` from being the PEM elliptic-curve key model-signing takes (which fails on others with an
    AttributeError of its own), or None."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    kind = "private" if private else "public"
    try:
        data = key.read_bytes()
        loaded = (serialization.load_pem_private_key(data, password.encode() if password else None) if private
                  else serialization.load_pem_public_key(data))
    except OSError as exc:
        return f"cannot be read: {exc.strerror or exc}"
    except TypeError as exc:  # a password given for an unencrypted key, or none for an encrypted one
        return f"cannot be opened: {_first_line(exc)}"
    except ValueError:  # not PEM, or a wrong password
        return (f"is not a PEM {kind} key (or its password is wrong)" if private
                else f"is not a PEM {kind} key")
    if not isinstance(loaded, ec.EllipticCurvePrivateKey | ec.EllipticCurvePublicKey):
        name = re.sub(r"^_|(Private|Public)Key$", "", type(loaded).__name__)
        return (f"holds a key of type {name}; model signing takes elliptic-curve keys (openssl ecparam -genkey "
                "-name prime256v1)")
    return None


def _describe_failure(exc: BaseException, path: Path) -> str:
    # The library's mismatch message is the repr of a list of digests (quotes escaped when a digest holds one);
    # name the files instead.
    text = str(exc)
    changed = re.findall(r"Hash mismatch for \\?'([^'\\]*)\\?'", text)
    if changed:
        names = [path.name if name == "." else name for name in changed]
        return f"contents differ from what was signed ({', '.join(names)})"
    return _first_line(exc)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip() or type(exc).__name__
    line = text.splitlines()[0]
    return line if len(line) <= 300 else line[:297] + "..."
