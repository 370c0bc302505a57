"""The quantizer contract: the declared error bound holds on Gaussian weights, running the layer from its stored form
(``linear``) agrees with the exact product, and a quantized tensor survives a save and load (safetensors for its
tensors, JSON for its settings) unchanged."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from rtx_conformance.rules import require
from rtxcore.contracts.quantizer import FP8_ROWS, QuantizedTensor, Quantizer, concat_rows, round_rows

# Linear-weight shapes [out_features, in_features] a quantizer must handle: multiples of 64, as in real models.
SHAPES = ((64, 64), (128, 256), (192, 576))


def quantize(quantizer: Quantizer, weight: torch.Tensor) -> QuantizedTensor:
    """``quantizer.quantize(weight)``, checked to return a :class:`QuantizedTensor`."""
    qt = quantizer.quantize(weight)
    require(isinstance(qt, QuantizedTensor), "quantizer.api",
            f"quantize() returned {type(qt).__name__}, not a QuantizedTensor")
    return qt


def dequantize(quantizer: Quantizer, qt: QuantizedTensor) -> torch.Tensor:
    """``quantizer.dequantize(qt)``, checked to return a tensor."""
    restored = quantizer.dequantize(qt)
    require(isinstance(restored, torch.Tensor), "quantizer.api",
            f"dequantize() returned {type(restored).__name__}, not a tensor")
    return restored


def relative_error(quantizer: Quantizer, weight: torch.Tensor) -> float:
    restored = dequantize(quantizer, quantize(quantizer, weight))
    return ((weight.float() - restored.float()).norm() / weight.float().norm()).item()


def check_declared_bound(quantizer: Quantizer) -> None:
    bound = quantizer.max_relative_error
    require(isinstance(bound, float) and 0 < bound < 1, "quantizer.declares_bound",
            f"max_relative_error is {bound!r}")


def check_error_bound(quantizer: Quantizer, weight: torch.Tensor) -> float:
    error = relative_error(quantizer, weight)
    require(error <= quantizer.max_relative_error, "quantizer.error_bound",
            f"relative error {error:.4g} on a {tuple(weight.shape)} weight (std {weight.std().item():.3g}) exceeds "
            f"the declared {quantizer.max_relative_error}")
    return error


def check_linear(quantizer: Quantizer, weight: torch.Tensor, seed: int, dtype: torch.dtype = torch.float32) -> float:
    """What a backend runs: ``linear`` on Gaussian rows stays within twice the declared weight bound of the exact
    product (room for methods that also round activations), in the input's dtype and shape."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(5, weight.shape[1], generator=gen).to(dtype)
    bias = torch.randn(weight.shape[0], generator=gen).to(dtype)
    exact = x.float() @ weight.float().t()
    out = quantizer.linear(x, quantize(quantizer, weight), bias)
    require(isinstance(out, torch.Tensor), "quantizer.api", f"linear() returned {type(out).__name__}, not a tensor")
    require(tuple(out.shape) == tuple(exact.shape) and out.dtype == dtype, "quantizer.linear",
            f"linear gave {tuple(out.shape)} {out.dtype} for {tuple(exact.shape)} {dtype}")
    error = ((out.float() - bias.float() - exact).norm() / exact.norm()).item()
    # A 16-bit input and output add their own rounding (bf16: 2^-9 relative per value) on top of the method's.
    allowed = 2 * quantizer.max_relative_error + (0 if dtype == torch.float32 else 0.01)
    require(error <= allowed, "quantizer.linear",
            f"linear's relative output error {error:.4g} in {dtype} exceeds {allowed:.4g} (twice the declared "
            f"{quantizer.max_relative_error})")
    return error


def check_rounded_rows(quantizer: Quantizer, weight: torch.Tensor, seed: int) -> int:
    """A backend hands ``linear`` its input already rounded wherever :meth:`Quantizer.rounded_rows` names a form
    for it: the result must be the bits ``linear`` gives for the input itself. Returns how many of the row counts
    tried named a form (built-in methods name none on the CPU)."""
    qt = quantize(quantizer, weight)
    named = 0
    for rows in (1, 9, 64):
        form = quantizer.rounded_rows(qt, rows, weight.device)
        if form is None:
            continue
        require(form is FP8_ROWS, "quantizer.rounded_rows", f"rounded_rows() named {form!r}, not a defined form")
        named += 1
        gen = torch.Generator().manual_seed(seed + rows)
        x = torch.randn(rows, weight.shape[1], generator=gen).to(weight.device, torch.bfloat16)
        rounded, plain = quantizer.linear(round_rows(x, form), qt), quantizer.linear(x, qt)  # type: ignore[arg-type]
        require(isinstance(rounded, torch.Tensor) and rounded.dtype == plain.dtype and torch.equal(rounded, plain),
                "quantizer.rounded_rows", f"linear() of {rows} rows given them rounded ({form.value}) differs from "
                "linear() given the rows themselves")
    return named


def check_fake_quantize(quantizer: Quantizer, weight: torch.Tensor) -> None:
    """QAT's view of the method: the stored form's rounding, with the identity's gradient."""
    w = weight.clone().requires_grad_(True)
    faked = quantizer.fake_quantize(w)
    require(isinstance(faked, torch.Tensor) and faked.shape == weight.shape, "quantizer.fake_quantize",
            f"fake_quantize() returned {type(faked).__name__} {getattr(faked, 'shape', '')}, not a "
            f"{tuple(weight.shape)} tensor")
    stored = dequantize(quantizer, quantize(quantizer, weight)).float()
    difference = (faked.detach().float() - stored).abs().max().item()
    require(difference <= 1e-6 * max(1.0, stored.abs().max().item()), "quantizer.fake_quantize",
            f"fake_quantize() differs from dequantize(quantize()) by up to {difference:.3g}")
    faked.sum().backward()
    require(w.grad is not None and torch.equal(w.grad, torch.ones_like(w)), "quantizer.fake_quantize",
            "the gradient through fake_quantize() is not the identity's (straight-through)")


def check_fusable(quantizer: Quantizer, weight: torch.Tensor) -> None:
    """Backends fuse layers that share an input (q|k|v) by stacking their quantized tensors along dimension 0: that
    must give the stacked weights' quantized form."""
    half = weight.shape[0] // 2
    top, bottom = quantize(quantizer, weight[:half]), quantize(quantizer, weight[half:])
    for key, t in top.tensors.items():
        along, size = ("input", weight.shape[1]) if key.startswith("input_") else ("output", half)
        require(t.dim() >= 1 and t.shape[0] == size, "quantizer.fusable",
                f"tensor {key!r} has shape {tuple(t.shape)}: its first dimension must be the {size} {along} features")
    try:
        stacked = concat_rows([top, bottom])
    except ValueError as exc:
        require(False, "quantizer.fusable", f"two halves of one weight cannot be stacked: {exc}")
    whole = torch.cat([dequantize(quantizer, top), dequantize(quantizer, bottom)])
    require(torch.equal(dequantize(quantizer, stacked), whole), "quantizer.fusable",
            "dequantizing the stacked tensors differs from stacking the dequantized halves")


def check_shape(quantizer: Quantizer, name: str, weight: torch.Tensor) -> None:
    qt = quantize(quantizer, weight)
    require(qt.method == name, "quantizer.shape", f"method is {qt.method!r}, expected the registered name {name!r}")
    require(tuple(qt.shape) == tuple(weight.shape) and qt.dtype == weight.dtype, "quantizer.shape",
            f"recorded {tuple(qt.shape)} {qt.dtype} for a {tuple(weight.shape)} {weight.dtype} weight")
    restored = dequantize(quantizer, qt)
    require(tuple(restored.shape) == tuple(weight.shape) and restored.dtype == weight.dtype, "quantizer.shape",
            f"dequantize gave {tuple(restored.shape)} {restored.dtype}, expected {tuple(weight.shape)} {weight.dtype}")


def save_quantized(qt: QuantizedTensor, path: Path) -> None:
    header = {"method": qt.method, "shape": list(qt.shape), "dtype": str(qt.dtype).removeprefix("torch."),
              "meta": qt.meta}
    tensors = {name: t.detach().cpu().contiguous() for name, t in qt.tensors.items()}
    save_file(tensors, str(path), metadata={"rtx_quantized": json.dumps(header)})


def load_quantized(path: Path) -> QuantizedTensor:
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        header = json.loads(f.metadata()["rtx_quantized"])
    return QuantizedTensor(method=header["method"], tensors=load_file(str(path)), shape=tuple(header["shape"]),
                           dtype=getattr(torch, header["dtype"]), meta=header["meta"])


def check_round_trip(quantizer: Quantizer, weight: torch.Tensor, directory: Path) -> None:
    qt = quantize(quantizer, weight)
    try:
        json.dumps(qt.meta)
    except TypeError as exc:
        require(False, "quantizer.round_trip", f"meta is not JSON-serializable: {exc}")
    path = directory / "weight.safetensors"
    try:
        save_quantized(qt, path)
    except Exception as exc:  # what safetensors refuses (non-tensors, shared storage) is the plugin's problem
        require(False, "quantizer.round_trip", f"its tensors cannot be saved: {type(exc).__name__}: {exc}")
    before = dequantize(quantizer, qt)
    after = dequantize(quantizer, load_quantized(path))
    require(torch.equal(before, after), "quantizer.round_trip",
            f"dequantized weight differs after save and load (max difference {(before - after).abs().max().item()})")
