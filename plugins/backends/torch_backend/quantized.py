"""Quantized linear layers in the torch backend: the weight kept in its quantizer's stored form and run through the
quantizer's own ``linear`` (Triton kernels on CUDA for the built-in methods)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from rtxcore.contracts.quantizer import QuantizedTensor, Quantizer, RoundedRows, RowRounding, concat_rows
from rtxcore.errors import ModelLoadError


@dataclass(slots=True)
class QuantizedWeight:
    quantizer: Quantizer
    qtensor: QuantizedTensor

    def linear(self, x: torch.Tensor | RoundedRows, bias: torch.Tensor | None) -> torch.Tensor:
        # RoundedRows only reach a quantizer whose rounded_rows named their form, and its linear takes them.
        return self.quantizer.linear(x, self.qtensor, bias)  # type: ignore[arg-type]


def to_device(qt: QuantizedTensor, device: torch.device) -> QuantizedTensor:
    return QuantizedTensor(qt.method, {k: t.to(device) for k, t in qt.tensors.items()}, qt.shape, qt.dtype, qt.meta)


class QuantizableLinear(nn.Module):
    """Mixin of the linear layers: holds ``weight`` until a quantized form replaces it.

    A layer fusing several checkpoint weights collects their quantized forms (``add_quantized_shard``) and switches
    once it has all of them; a float weight is swapped for its quantized form with ``quantize``.
    """

    quantized: QuantizedWeight | None = None

    def _shard_rows(self, shard_index: int) -> int:
        sizes = getattr(self, "shard_sizes", None)
        return sizes[shard_index] if sizes is not None else self.weight.shape[0]

    def _init_quantization(self, num_shards: int) -> None:
        self.quantized = None
        self._num_shards = num_shards
        self._pending: dict[int, tuple[QuantizedTensor, Quantizer]] = {}

    def local_share(self, qt: QuantizedTensor, quantizer: Quantizer) -> QuantizedTensor:
        """This rank's share of a whole checkpoint weight (tensor parallelism); the layer's class knows which."""
        return qt

    def add_quantized_shard(self, qt: QuantizedTensor, quantizer: Quantizer, shard_index: int, name: str) -> None:
        try:
            quantizer.check(qt)  # the whole weight, as stored, before it is cut
        except ValueError as exc:
            raise ModelLoadError(f"{name}: damaged {qt.method} weight: {exc}") from None
        if self.ctx.tp_size > 1:
            try:
                qt = self.local_share(qt, quantizer)
            except ValueError as exc:
                raise ModelLoadError(f"{name}: cannot split this {qt.method} weight across "
                                     f"{self.ctx.tp_size} tensor-parallel ranks: {exc}") from None
        expected = (self._shard_rows(shard_index), self.weight.shape[1])
        if tuple(qt.shape) != expected:
            raise ModelLoadError(f"{name}: quantized weight of shape {tuple(qt.shape)}; the model needs {expected}")
        self._pending[shard_index] = (qt, quantizer)
        if len(self._pending) == self._num_shards:
            parts = [self._pending[i] for i in range(self._num_shards)]
            try:
                fused = concat_rows([qt for qt, _ in parts])
            except ValueError as exc:
                raise ModelLoadError(f"{name}: the layers fused with it are quantized differently ({exc}); "
                                     "quantize them alike") from None
            self._set(QuantizedWeight(parts[0][1], fused))
            self._pending = {}

    def quantize(self, quantizer: Quantizer) -> None:
        self._set(QuantizedWeight(quantizer, quantizer.quantize(self.weight.data)))

    def _set(self, quantized: QuantizedWeight) -> None:
        self.quantized = quantized
        # The float weight is no longer read: give its memory back.
        self.weight = nn.Parameter(torch.empty(0, dtype=self.weight.dtype, device=self.weight.device),
                                   requires_grad=False)

    def rounded_rows(self, num_rows: int, device: torch.device) -> RowRounding | None:
        """The form in which this layer takes an input of ``num_rows`` rows already rounded (its quantizer's
        :meth:`~rtxcore.contracts.quantizer.Quantizer.rounded_rows`), or None: then it takes the rows as they are."""
        if self.quantized is None:
            return None
        return self.quantized.quantizer.rounded_rows(self.quantized.qtensor, num_rows, device)

    @property
    def waiting_for_shards(self) -> bool:
        return bool(self._pending)
