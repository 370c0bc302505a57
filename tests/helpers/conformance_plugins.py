"""Plugins for the conformance tests: deliberately wrong ones, each breaking one rule.

Registered inline (``load_plugins(extra=...)``), as a third party's would be through an entry point.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from rtx_plugins.eviction.lru import LRUPolicy
from rtx_plugins.quantizers.fp8 import FP8Quantizer
from rtx_plugins.samplers.default import DefaultSampler
from rtx_plugins.schedulers.fcfs import FCFSScheduler
from rtxcore.contracts import QuantizedTensor, Quantizer, SchedulerConfig
from rtxcore.contracts.quantizer import FP8_ROWS, RoundedRows
from rtxcore.hookspecs import hookimpl


class LeakyTopKSampler(DefaultSampler):
    """Off by one: keeps k + 1 tokens when asked for top-k."""

    def sample(self, logits, batch):
        widened = [replace(p, top_k=p.top_k + 1) if p.top_k else p for p in batch.params]
        return super().sample(logits, replace(batch, params=widened))


class HitEvictingPolicy(LRUPolicy):
    """Evicts the block hit last, forgetting that a hit puts the block back in use."""

    def __init__(self, capacity: int):
        super().__init__(capacity)
        self.last_hit: int | None = None

    def touch(self, block_id: int) -> None:
        super().touch(block_id)
        self.last_hit = block_id

    def evict(self) -> int | None:
        if self.last_hit is not None:
            block_id, self.last_hit = self.last_hit, None
            self.forget(block_id)
            return block_id
        return super().evict()


class OverBudgetScheduler(FCFSScheduler):
    """Reads the token budget as twice what it is."""

    def __init__(self, config: SchedulerConfig, kv_cache):
        doubled = SchedulerConfig(config.max_num_batched_tokens * 2, config.max_num_seqs,
                                  config.enable_chunked_prefill)
        super().__init__(doubled, kv_cache)


class Int8Quantizer(Quantizer):
    """Symmetric per-output-channel int8: each row scaled by its largest magnitude over 127."""

    # Rounding error is uniform within half a step; a Gaussian row's maximum is about 3 standard deviations, so the
    # relative error is about 3 / 127 / sqrt(12) = 0.007.
    max_relative_error = 0.01
    levels = 127
    name = "int8"

    def quantize(self, weight: torch.Tensor, stats=None) -> QuantizedTensor:
        scale = weight.float().abs().amax(dim=1, keepdim=True).clamp_min(1e-12) / self.levels
        values = (weight.float() / scale).round().clamp(-self.levels, self.levels).to(torch.int8)
        return QuantizedTensor(self.name, {"values": values, "scale": scale}, tuple(weight.shape), weight.dtype,
                               {"bits": 8, "axis": 0})

    def dequantize(self, qtensor: QuantizedTensor) -> torch.Tensor:
        return (qtensor.tensors["values"].float() * qtensor.tensors["scale"]).to(qtensor.dtype)


class OverpromisingInt4Quantizer(Int8Quantizer):
    """Int4 levels, but still promising int8's error bound."""

    levels = 7
    name = "int4-overpromising"


class UnroundedFakeQuantizer(Int8Quantizer):
    """Trains on the float weight: quantization-aware training would never see the rounding."""

    name = "int8-unrounded-qat"

    def fake_quantize(self, weight: torch.Tensor) -> torch.Tensor:
        return weight


class RoundedRowsFP8Quantizer(FP8Quantizer):
    """fp8 taking its input rounded beforehand for any rows anywhere (the CPU included): a right one, whose linear
    reads rounded rows as the built-in does."""

    def rounded_rows(self, qtensor, num_rows, device):
        return FP8_ROWS


class ScaleDroppingFP8Quantizer(RoundedRowsFP8Quantizer):
    """Takes rounded rows but reads them without their scales."""

    def linear(self, x, qtensor, bias=None):
        if isinstance(x, RoundedRows):
            x = RoundedRows(x.form, x.values, torch.ones_like(x.scale), x.dtype)
        return super().linear(x, qtensor, bias)


class WrongPlugins:
    @hookimpl
    def register_samplers(self, register):
        register("leaky-top-k", LeakyTopKSampler)

    @hookimpl
    def register_eviction_policies(self, register):
        register("hit-evicting", HitEvictingPolicy)

    @hookimpl
    def register_schedulers(self, register):
        register("over-budget", OverBudgetScheduler)

    @hookimpl
    def register_quantizers(self, register):
        register("int4-overpromising", OverpromisingInt4Quantizer)
        register("int8-unrounded-qat", UnroundedFakeQuantizer)
        register("fp8-scale-dropping", ScaleDroppingFP8Quantizer)
