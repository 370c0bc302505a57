"""Quantizer contract: store a linear weight in fewer bits, give back an approximation on demand, and run the
layer from the stored form."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from enum import Enum

import torch
import torch.nn.functional as F


@dataclass(slots=True)
class QuantizedTensor:
    # Name of the method that produced it (the quantizer's registered name).
    method: str
    # Tensors that together encode the weight (packed values, scales, zero points...), saved as they are. The first
    # dimension of every one is the weight's output features, so the weights of layers fused along their outputs
    # (q|k|v, gate|up) are fused by concatenating each tensor along dimension 0. The prefix ``input_`` is reserved
    # for tensors that run along the input features instead (a per-channel smoothing of x, say): fused layers read
    # one input, so theirs must be equal (they may depend on the input's statistics, not on the weight), and the
    # fused weight keeps one.
    tensors: dict[str, torch.Tensor]
    # The original weight's shape and dtype, to rebuild it.
    shape: tuple[int, ...]
    dtype: torch.dtype
    # Method-specific settings (group size, bits...), JSON-serializable.
    meta: dict = field(default_factory=dict)


class RowRounding(Enum):
    """The forms of pre-rounded input a quantizer's ``linear`` may take (:class:`RoundedRows`)."""

    #: Each row scaled so that its largest magnitude is fp8 e4m3's largest (448), then rounded to e4m3, nearest even.
    FP8_E4M3 = "fp8-e4m3-rows"


FP8_ROWS = RowRounding.FP8_E4M3


@dataclass(frozen=True, slots=True)
class RoundedRows:
    """A linear layer's input already rounded as its quantizer rounds activations, by the kernel that made it (an
    RMSNorm or SiLU-and-mul can round its output in the same pass instead of a kernel of its own before the layer):
    ``x`` ~= ``values.float() * scale``. Made only for a layer whose :meth:`Quantizer.rounded_rows` named the form."""

    form: RowRounding
    values: torch.Tensor  # [rows, in_features]
    scale: torch.Tensor  # float32 [rows, 1]
    # The dtype of the unrounded rows: the layer's output takes it.
    dtype: torch.dtype


def round_rows(x: torch.Tensor, form: RowRounding = FP8_ROWS) -> RoundedRows:
    """The rows of ``x`` [rows, K] rounded into ``form``, by the form's definition: the reference a fused kernel must
    equal bit for bit, and the rounding the fp8 quantizer applies to its input itself."""
    if form is not FP8_ROWS:
        raise ValueError(f"unknown rounded-rows form {form!r}")
    fp8 = torch.float8_e4m3fn
    levels = torch.finfo(fp8).max
    # Times the reciprocal, not divided: torch divides by a Python number that way on CUDA but not on the CPU, and
    # the scale must be the same bits everywhere (rtx_kernels.quant_rows computes it too).
    scale = x.abs().amax(dim=-1, keepdim=True).float().clamp_min(1e-12) * (1.0 / levels)
    return RoundedRows(form, (x.float() / scale).clamp(-levels, levels).to(fp8), scale, x.dtype)


@dataclass(slots=True)
class LayerStats:
    """What calibration text looked like at one linear layer's input ``x`` [rows, in_features]."""

    # Sum over the rows of x x^T, float32 [in_features, in_features]: ||x W^T||^2 = trace(W H W^T). Empty when no
    # calibrated method was asked for (it is the costly part).
    hessian: torch.Tensor
    num_rows: int
    # Largest |x| of each input feature, float32 [in_features].
    abs_max: torch.Tensor
    # Some of the rows themselves, float32 [<= rows, in_features]: output errors are measured on them.
    sample: torch.Tensor


class Quantizer(ABC):
    #: Largest relative error (||W - dequant(quant(W))|| / ||W||) the quantizer promises on Gaussian weights.
    max_relative_error: float = 0.0
    #: Whether :meth:`quantize` makes use of calibration statistics (``rtx quantize`` collects them only then).
    calibrated: bool = False
    #: Whether a calibrated method reads ``LayerStats.hessian``, the costly part (in_features^2 per layer): without
    #: it ``rtx quantize`` collects only the per-feature maxima and sample rows.
    uses_hessian: bool = True
    #: Largest relative error of a layer's output on calibration text before ``rtx quantize`` gives the layer to
    #: :attr:`fallback` instead (``--max-layer-error`` overrides it).
    layer_error_budget: float = 0.1
    #: The registered name of the higher-precision method a layer over budget falls back to; None: the layer keeps
    #: the checkpoint's precision.
    fallback: str | None = None

    @abstractmethod
    def quantize(self, weight: torch.Tensor, stats: LayerStats | None = None) -> QuantizedTensor:
        """:param weight: a 2-D linear weight [out_features, in_features].
        :param stats: the layer's calibration statistics when there are some; a calibrated method must still work
            without them (as plain rounding)."""

    @abstractmethod
    def dequantize(self, qtensor: QuantizedTensor) -> torch.Tensor:
        """Rebuild an approximation of the original weight."""

    def check(self, qtensor: QuantizedTensor) -> None:
        """Raise ValueError, naming the problem, when ``qtensor``'s tensors do not fit its shape and settings (a
        damaged checkpoint): loaders call it before a layer runs. The default trusts the tensors."""

    def slice_inputs(self, qtensor: QuantizedTensor, start: int, size: int) -> QuantizedTensor:
        """The weight's input features ``start .. start + size`` alone, in stored form: a tensor-parallel rank's
        share of a row-parallel layer (its share of a column-parallel one is :func:`slice_rows`, the same for every
        method). It must dequantize to those columns of the whole weight.

        :raises ValueError: the stored form cannot be cut there (a group or a packed word would be split); the
            default cannot cut any.
        """
        raise ValueError(f"{qtensor.method} weights cannot be split along their input features (the quantizer "
                         "does not implement slice_inputs)")

    def linear(self, x: torch.Tensor, qtensor: QuantizedTensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """``x @ W^T + bias`` from the stored form, in ``x``'s dtype: what a backend runs for a quantized layer.

        This reference rebuilds the weight on every call; built-in methods override it with kernels that read the
        packed weight directly, and methods that also quantize activations (fp8) apply that here."""
        return F.linear(x, self.dequantize(qtensor).to(x.dtype), bias)

    def rounded_rows(self, qtensor: QuantizedTensor, num_rows: int, device: torch.device) -> RowRounding | None:
        """The :class:`RoundedRows` form (:data:`FP8_ROWS`) in which :meth:`linear` would round an input of
        ``num_rows`` rows on ``device`` and also takes it rounded beforehand, or None (the default: the method does
        not round its input, or not for this many rows there). A backend may then hand ``linear`` a
        :class:`RoundedRows` of that form in place of ``x``, and the result must be the same bits."""
        return None

    # -- quantization-aware training (rtxcore.quant.qat) ----------------------------------------------------------

    def fake_quantize(self, weight: torch.Tensor) -> torch.Tensor:
        """``weight`` as this method stores it (quantized, then dequantized), with the gradient of the identity
        (straight-through estimator): a training loop sees the rounding in its loss and still updates the float
        weight. The default rounds through :meth:`quantize` and :meth:`dequantize` with no statistics."""
        with torch.no_grad():
            rounded = self.dequantize(self.quantize(weight.detach().float())).to(weight.dtype)
        return weight + (rounded - weight).detach()

    def fake_quantize_input(self, x: torch.Tensor) -> torch.Tensor:
        """A layer's input as the method rounds it when the layer runs (activations of fp8 and int8-sq), straight
        through for the gradient; the input unchanged for weight-only methods (the default)."""
        return x


def concat_rows(parts: list[QuantizedTensor]) -> QuantizedTensor:
    """One quantized weight from weights stacked along their outputs (q|k|v): every tensor concatenated along
    dimension 0, which the contract makes the output features, but the ``input_*`` ones, shared.

    :raises ValueError: see :func:`check_stackable`.
    """
    check_stackable(parts)
    first = parts[0]
    if len(parts) == 1:
        return first
    tensors = {key: first.tensors[key] if key.startswith("input_") else torch.cat([p.tensors[key] for p in parts])
               for key in first.tensors}
    return QuantizedTensor(first.method, tensors, (sum(p.shape[0] for p in parts), *first.shape[1:]), first.dtype,
                           first.meta)


def slice_rows(qtensor: QuantizedTensor, start: int, size: int) -> QuantizedTensor:
    """The weight's output features ``start .. start + size`` alone: every tensor cut along dimension 0, which the
    contract makes the output features, but the ``input_*`` ones, kept whole (a column-parallel rank's share)."""
    tensors = {key: t if key.startswith("input_") else t.narrow(0, start, size).contiguous()
               for key, t in qtensor.tensors.items()}
    return QuantizedTensor(qtensor.method, tensors, (size, *qtensor.shape[1:]), qtensor.dtype, qtensor.meta)


def narrow_inputs(qtensor: QuantizedTensor, start: int, size: int, per_feature: dict[str, int]) -> QuantizedTensor:
    """``qtensor`` cut to input features ``start .. start + size``, for :meth:`Quantizer.slice_inputs`.

    :param per_feature: each tensor that runs along the input features, with how many input features one of its
        elements covers along that dimension (1 for plain values, 8 for int4 words, the group size for group
        scales): dimension 1 for weight-shaped tensors, dimension 0 for the ``input_*`` vectors. The others (one
        value per output row) are kept whole.
    :raises ValueError: a cut that would split an element.
    """
    tensors = dict(qtensor.tensors)
    for key, span in per_feature.items():
        if start % span or size % span:
            raise ValueError(f"{qtensor.method} {key!r} covers {span} input features an element: it cannot be cut at "
                             f"{start}..{start + size}")
        dim = 0 if key.startswith("input_") else 1
        tensors[key] = tensors[key].narrow(dim, start // span, size // span).contiguous()
    return QuantizedTensor(qtensor.method, tensors, (qtensor.shape[0], size), qtensor.dtype, qtensor.meta)


def check_stackable(parts: list[QuantizedTensor]) -> None:
    """Raise ValueError unless :func:`concat_rows` can stack ``parts``: quantized alike (method, settings, tensors,
    input features) and with equal ``input_*`` tensors."""
    first = parts[0]
    for part in parts[1:]:
        if (part.method, part.meta, part.tensors.keys(), part.shape[1:]) != (first.method, first.meta,
                                                                             first.tensors.keys(), first.shape[1:]):
            raise ValueError(f"cannot stack a {part.method} {part.meta} weight of shape {part.shape} under a "
                             f"{first.method} {first.meta} one of shape {first.shape}")
        for key in (k for k in first.tensors if k.startswith("input_")):
            if not torch.equal(part.tensors[key], first.tensors[key]):
                raise ValueError(f"cannot stack weights whose {key!r} differ: they must read their input alike")


def require_tensor(qtensor: QuantizedTensor, key: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """``qtensor.tensors[key]``, checked to have ``shape`` and ``dtype`` (finite values for a float); for
    :meth:`Quantizer.check`."""
    t = qtensor.tensors.get(key)
    if t is None:
        raise ValueError(f"no {key!r} tensor")
    if tuple(t.shape) != tuple(shape) or t.dtype != dtype:
        raise ValueError(f"{key!r} is {tuple(t.shape)} {t.dtype}, expected {tuple(shape)} {dtype}")
    if t.is_floating_point() and t.element_size() > 1 and not torch.isfinite(t).all():
        raise ValueError(f"{key!r} holds non-finite values")
    return t
