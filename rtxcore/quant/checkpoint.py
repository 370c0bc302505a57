"""The quantized checkpoint ``rtx quantize`` writes and ``rtx serve --model DIR`` loads.

A Hugging Face style directory: ``config.json`` (the model's config plus a ``quantization_config``),
``model.safetensors``, the tokenizer's files and ``quantization_report.json``. Tensor names and the
``quantization_config`` follow the compressed-tensors layout where it fits (``<layer>.weight_packed``,
``weight_scale``, ``weight_zero_point``; ``config_groups``, ``ignore``); int4 values are unsigned nibbles with a
zero point, eight to an int32 along the input features. The ``rtx`` section records each layer's method, its
tensors and the checksum of the weights file, which is verified before anything is read.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Iterator

import torch

from rtxcore.contracts.quantizer import QuantizedTensor
from rtxcore.errors import ConfigError, ModelLoadError
from rtxcore.files import fsync_dir

WEIGHTS_FILE = "model.safetensors"
REPORT_FILE = "quantization_report.json"
FORMAT_VERSION = 1
# compressed-tensors' format name of each built-in method's layout.
# int8-sq's weight holds W times its smoothing: only "quant_method": "rtx-serve" keeps other loaders off it.
_FORMATS = {"int8": "int-quantized", "int8-sq": "int-quantized", "int4": "pack-quantized",
            "int4-gptq": "pack-quantized", "fp8": "float-quantized"}


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 24), b""):
            digest.update(chunk)
    return digest.hexdigest()


def check_output_dir(out: Path) -> None:
    """Refuse a ``--out`` that holds something, or whose parent cannot take a new directory: a checkpoint is written
    whole or not at all, never over another."""
    if out.is_symlink():  # the staged directory would replace the link, not fill what it points to
        raise ConfigError(f"--out {out} is a symbolic link: give the directory it points to")
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConfigError(f"--out {out} already exists and is not an empty directory")
    if not out.parent.is_dir():
        raise ConfigError(f"--out {out}: its parent {out.parent} is not an existing directory")
    # Tried for real, as the checkpoint will be staged there: permission bits alone do not tell, as root, that
    # nothing can be made in /proc or on a read-only mount, which only the final write found, after calibration.
    try:
        os.rmdir(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".check", dir=out.parent))
    except OSError as exc:
        raise ConfigError(f"--out {out}: cannot create a directory in {out.parent} "
                          f"({exc.strerror or exc})") from None


def quantization_config(layers: dict[str, QuantizedTensor], ignored: list[str], checksum: str,
                        extra: dict[str, Any]) -> dict[str, Any]:
    groups: dict[str, dict[str, Any]] = {}
    for name, qt in layers.items():
        key = json.dumps([qt.method, qt.meta], sort_keys=True)
        group = groups.setdefault(key, {"targets": [], "weights": {
            "num_bits": qt.meta.get("bits"), "type": "float" if qt.method == "fp8" else "int",
            "symmetric": qt.meta.get("symmetric", True), "strategy": qt.meta.get("strategy"),
            "group_size": qt.meta.get("group_size")}, "rtx_method": qt.method})
        group["targets"].append(name.removesuffix(".weight"))
    methods = {qt.method for qt in layers.values()}
    formats = {_FORMATS.get(m, "custom") for m in methods}
    return {
        # Not "compressed-tensors": the names follow it, but int4's unsigned nibbles and uint8 zero points do not,
        # and a loader taking it for compressed-tensors would read them wrong.
        "quant_method": "rtx-serve",
        "format": formats.pop() if len(formats) == 1 else "mixed-precision",
        "config_groups": {f"group_{i}": g for i, g in enumerate(groups.values())},
        "ignore": [name.removesuffix(".weight") for name in ignored],
        "rtx": {
            "format_version": FORMAT_VERSION,
            "layers": {name: {"method": qt.method, "shape": list(qt.shape), "dtype": _dtype_name(qt.dtype),
                              "meta": qt.meta, "tensors": sorted(qt.tensors)} for name, qt in layers.items()},
            "sha256": {WEIGHTS_FILE: checksum},
            **extra,
        },
    }


@contextlib.contextmanager
def staged_checkpoint(out: Path) -> Iterator[Path]:
    """A fresh directory beside ``out`` to write the checkpoint into, renamed to ``out`` when the block ends without
    an error; otherwise removed, so nothing is ever left at ``out`` half-written."""
    check_output_dir(out)
    try:
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".partial", dir=out.parent))
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o777 & ~umask)  # mkdtemp's 0700 would hide the model from a server running as another user
    except OSError as exc:
        raise ConfigError(f"--out {out}: {exc.strerror}") from None
    try:
        yield tmp
        for path in tmp.iterdir():
            if path.is_file():
                os.chmod(path, 0o666 & ~umask)  # safetensors writes 0600, hiding it the same way
            with open(path, "rb") as f:
                os.fsync(f.fileno())
        if out.exists():
            out.rmdir()  # empty, checked above
        os.replace(tmp, out)
        fsync_dir(out.parent)
    except BaseException as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(exc, OSError):
            raise ConfigError(f"writing {out}: {exc}") from None
        raise


def write_checkpoint(directory: Path, hf_config: dict[str, Any], tensors: dict[str, torch.Tensor | QuantizedTensor],
                     report: dict[str, Any], tokenizer=None, extra: dict[str, Any] | None = None) -> None:
    """Write the checkpoint's files into ``directory`` (a :func:`staged_checkpoint`)."""
    from safetensors.torch import save_file

    flat: dict[str, torch.Tensor] = {}
    layers: dict[str, QuantizedTensor] = {}
    for name, value in tensors.items():
        if isinstance(value, QuantizedTensor):
            layers[name] = value
            prefix = name.removesuffix(".weight")
            flat.update({f"{prefix}.{key}": t.detach().cpu().contiguous() for key, t in value.tensors.items()})
        else:
            flat[name] = value.detach().cpu().contiguous()
    save_file(flat, str(directory / WEIGHTS_FILE), metadata={"format": "pt", "producer": "rtx-serve"})
    ignored = [name for name, v in tensors.items() if not isinstance(v, QuantizedTensor) and v.dim() == 2]
    config = dict(hf_config, quantization_config=quantization_config(
        layers, ignored, sha256_file(directory / WEIGHTS_FILE), extra or {}))
    (directory / "config.json").write_text(json.dumps(config, indent=1))
    write_report(directory, report)
    if tokenizer is not None:
        tokenizer.save(directory)


def write_report(directory: Path, report: dict[str, Any]) -> None:
    (directory / REPORT_FILE).write_text(json.dumps(report, indent=1))


def rtx_section(config: dict[str, Any]) -> dict[str, Any] | None:
    quantization = config.get("quantization_config") if isinstance(config, dict) else None
    section = quantization.get("rtx") if isinstance(quantization, dict) else None
    return section if isinstance(section, dict) else None


def read_weights(directory: Path, section: dict[str, Any]) -> Iterator[tuple[str, torch.Tensor | QuantizedTensor]]:
    """Yield the checkpoint's weights, quantized layers as :class:`QuantizedTensor`, after checking the file's
    checksum and each layer's tensors against what the config says of them.

    :raises ModelLoadError: naming what is damaged or missing.
    """
    from safetensors import SafetensorError, safe_open

    path = directory / WEIGHTS_FILE
    if not path.is_file():
        raise ModelLoadError(f"{directory}: quantized checkpoint without its {WEIGHTS_FILE}")
    if section.get("format_version") != FORMAT_VERSION:
        raise ModelLoadError(f"{directory}/config.json: quantized checkpoint format version "
                             f"{section.get('format_version')!r}; this rtx-serve reads {FORMAT_VERSION}")
    expected = (section.get("sha256") or {}).get(WEIGHTS_FILE)
    if not isinstance(expected, str):
        raise ModelLoadError(f"{directory}/config.json: quantization_config.rtx.sha256 lacks {WEIGHTS_FILE}'s checksum")
    if sha256_file(path) != expected:
        raise ModelLoadError(f"{path}: damaged quantized checkpoint (its checksum does not match config.json's)")
    layers = section.get("layers")
    if not isinstance(layers, dict):
        raise ModelLoadError(f"{directory}/config.json: quantization_config.rtx.layers is missing")
    try:
        with safe_open(str(path), framework="pt") as f:
            keys = set(f.keys())
            owned: set[str] = set()
            for name, info in layers.items():
                yield name, _read_layer(f, keys, name, info, path)
                owned.update(f"{name.removesuffix('.weight')}.{key}" for key in info["tensors"])
            for key in sorted(keys - owned):
                yield key, f.get_tensor(key)
    except SafetensorError as exc:
        raise ModelLoadError(f"{path}: damaged safetensors file ({exc})") from None


def _read_layer(f, keys: set[str], name: str, info: dict[str, Any], path: Path) -> QuantizedTensor:
    try:
        method, shape, meta, tensor_keys = info["method"], tuple(info["shape"]), info["meta"], info["tensors"]
        dtype = getattr(torch, info["dtype"])
        if not isinstance(meta, dict):
            raise TypeError(f"meta {meta!r} is not a table")
        if len(shape) != 2:
            raise TypeError(f"shape {list(shape)} is not [out_features, in_features]")
    except (KeyError, TypeError, AttributeError) as exc:
        raise ModelLoadError(f"{path.parent}/config.json: layer {name}: malformed entry ({exc!r})") from None
    prefix = name.removesuffix(".weight")
    tensors = {}
    for key in tensor_keys:
        if f"{prefix}.{key}" not in keys:
            raise ModelLoadError(f"{path}: layer {name} lacks its tensor {prefix}.{key}")
        t = f.get_tensor(f"{prefix}.{key}")
        # input_* tensors run along the input features (see QuantizedTensor), the others along the outputs.
        along, size = ("input", shape[1]) if key.startswith("input_") else ("output", shape[0])
        if t.dim() == 0 or t.shape[0] != size:
            raise ModelLoadError(f"{path}: {prefix}.{key} has shape {tuple(t.shape)}; the layer has {size} {along} "
                                 "features")
        if t.is_floating_point() and t.dtype.itemsize > 1 and not torch.isfinite(t).all():
            raise ModelLoadError(f"{path}: {prefix}.{key} holds non-finite values")
        tensors[key] = t
    return QuantizedTensor(method, tensors, shape, dtype, meta)
