"""Building blocks of the decoder, written for tensor parallelism.

Linear layers are column- or row-parallel in the Megatron sense: a column-parallel layer holds ``1/tp_size`` of
the output features, a row-parallel one ``1/tp_size`` of the input features followed by an all-reduce. Each
parameter carries a ``weight_loader`` that copies its own shard out of a full checkpoint tensor, so the loading code
is the same for any parallel size.

With pipeline parallelism each rank also belongs to one stage, which holds a contiguous run of the decoder layers
(``ParallelContext.stage_layers``); the tensor-parallel collectives then run inside that stage's own group.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from rtx_plugins.backends.torch_backend.ops import Ops
from rtx_plugins.backends.torch_backend.quantized import QuantizableLinear
from rtxcore.contracts.quantizer import FP8_ROWS, QuantizedTensor, Quantizer, RoundedRows, slice_rows
from rtxcore.models.config import RopeScaling


@dataclass(frozen=True, slots=True)
class ParallelContext:
    """Where this rank sits: its tensor-parallel rank inside its stage, and its pipeline stage."""

    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1
    # The process group of this rank's stage (its tensor-parallel peers); None: the default (whole-world) group.
    tp_group: object = None

    def shard(self, size: int, what: str) -> int:
        if size % self.tp_size:
            raise ValueError(f"{what} ({size}) is not divisible by the tensor-parallel size {self.tp_size}")
        return size // self.tp_size

    @property
    def first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    def stage_layers(self, num_layers: int) -> range:
        """The decoder layers this rank's stage runs: an equal, contiguous share (the size divides the layers)."""
        per_stage = num_layers // self.pp_size
        return range(self.pp_rank * per_stage, (self.pp_rank + 1) * per_stage)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp_size > 1:
            torch.distributed.all_reduce(x, group=self.tp_group)
        return x

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """The stage's ranks' ``x`` side by side along the last dimension, in rank order."""
        if self.tp_size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.tp_size)]
        torch.distributed.all_gather(parts, x, group=self.tp_group)
        return torch.cat(parts, dim=-1)


def check_shape(full: torch.Tensor, expected: tuple[int, ...]) -> None:
    # copy_ broadcasts: a [128, 1] tensor would fill a [128, 64] weight without a word.
    if tuple(full.shape) != expected:
        raise ValueError(f"has shape {list(full.shape)}, expected {list(expected)}")


def _narrow(full: torch.Tensor, dim: int, rank: int, size: int) -> torch.Tensor:
    return full.narrow(dim, rank * size, size)


class ColumnParallelLinear(QuantizableLinear):
    """y = x W^T with W's output rows split across ranks; each rank returns its slice of y."""

    def __init__(self, in_features: int, out_sizes: list[int], bias: bool, ctx: ParallelContext, ops: Ops):
        super().__init__()
        self.ctx = ctx
        self.ops = ops
        # A merged layer (q|k|v, gate|up) stores several logical weights stacked along the output dimension.
        self.shard_sizes = [ctx.shard(s, "output features") for s in out_sizes]
        self.shard_offsets = [sum(self.shard_sizes[:i]) for i in range(len(out_sizes))]
        out_local = sum(self.shard_sizes)
        self.weight = nn.Parameter(torch.empty(out_local, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_local), requires_grad=False) if bias else None
        self._init_quantization(len(out_sizes))

    def load_shard(self, param: torch.Tensor, full: torch.Tensor, shard_index: int = 0) -> None:
        size = self.shard_sizes[shard_index]
        check_shape(full, (size * self.ctx.tp_size, *param.shape[1:]))
        local = _narrow(full, 0, self.ctx.tp_rank, size)
        param.data.narrow(0, self.shard_offsets[shard_index], size).copy_(local)

    def local_share(self, qt: QuantizedTensor, quantizer: Quantizer) -> QuantizedTensor:
        size = qt.shape[0] // self.ctx.tp_size
        return slice_rows(qt, self.ctx.tp_rank * size, size)

    def forward(self, x: torch.Tensor | RoundedRows) -> torch.Tensor:
        """``x`` comes as RoundedRows only where :meth:`rounded_rows` named their form (a quantized layer)."""
        if self.quantized is not None:
            return self.quantized.linear(x, self.bias)
        return self.ops.linear(x, self.weight, self.bias)  # type: ignore[arg-type]


class RowParallelLinear(QuantizableLinear):
    """y = x W^T with W's input columns split across ranks; partial products are summed by all-reduce."""

    def __init__(self, in_features: int, out_features: int, bias: bool, ctx: ParallelContext, ops: Ops):
        super().__init__()
        self.ctx = ctx
        self.ops = ops
        self.in_local = ctx.shard(in_features, "input features")
        self.weight = nn.Parameter(torch.empty(out_features, self.in_local), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None
        self._init_quantization(1)

    def load_shard(self, param: torch.Tensor, full: torch.Tensor, shard_index: int = 0) -> None:
        if param.dim() == 2:
            check_shape(full, (param.shape[0], self.in_local * self.ctx.tp_size))
            full = _narrow(full, 1, self.ctx.tp_rank, self.in_local)
        check_shape(full, tuple(param.shape))
        param.data.copy_(full)

    def local_share(self, qt: QuantizedTensor, quantizer: Quantizer) -> QuantizedTensor:
        return quantizer.slice_inputs(qt, self.ctx.tp_rank * self.in_local, self.in_local)

    def forward(self, x: torch.Tensor | RoundedRows) -> torch.Tensor:
        """``x`` comes as RoundedRows only where :meth:`rounded_rows` named their form (a quantized layer)."""
        y = (self.quantized.linear(x, None) if self.quantized is not None
             else self.ops.linear(x, self.weight, None))  # type: ignore[arg-type]
        y = self.ctx.all_reduce(y)
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(nn.Module):
    """Token embedding with the vocabulary split across ranks (tokens outside a rank's range embed to zero)."""

    def __init__(self, vocab_size: int, hidden_size: int, ctx: ParallelContext, ops: Ops):
        super().__init__()
        self.ctx = ctx
        self.ops = ops
        self.vocab_local = ctx.shard(vocab_size, "vocabulary size")
        self.vocab_start = ctx.tp_rank * self.vocab_local
        self.weight = nn.Parameter(torch.empty(self.vocab_local, hidden_size), requires_grad=False)

    def load_shard(self, param: torch.Tensor, full: torch.Tensor, shard_index: int = 0) -> None:
        check_shape(full, (self.vocab_local * self.ctx.tp_size, *param.shape[1:]))
        param.data.copy_(_narrow(full, 0, self.ctx.tp_rank, self.vocab_local))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.ctx.tp_size == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.vocab_start
        inside = (local >= 0) & (local < self.vocab_local)
        out = F.embedding(local.clamp(0, self.vocab_local - 1), self.weight) * inside.unsqueeze(-1)
        return self.ctx.all_reduce(out)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Project hidden states onto the vocabulary (tied or separate LM head)."""
        return self.ctx.all_gather(self.ops.linear(hidden, self.weight, None))


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float, ops: Ops):
        super().__init__()
        self.eps = eps
        self.ops = ops
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None,
                feeds: QuantizableLinear | None = None) -> tuple[torch.Tensor | RoundedRows, torch.Tensor]:
        """Returns (normalized, new residual); with ``residual`` given, x is added to it first (one kernel on GPU).

        :param feeds: the layer the normalized rows go to: where it takes them rounded to fp8 and a fused kernel
            exists, they come back so (:class:`RoundedRows`), rounded in the same pass.
        """
        fused = self.ops.rms_norm_fp8
        # 16-bit rows only: float32 ones' sum of squares may round differently in the fused kernel (kernels/rmsnorm.py).
        if (fused is not None and feeds is not None and x.element_size() == 2
                and feeds.rounded_rows(x.shape[0], x.device) is FP8_ROWS):
            values, scale, residual = fused(x, self.weight, self.eps, residual)
            return RoundedRows(FP8_ROWS, values, scale, torch.promote_types(self.weight.dtype, x.dtype)), residual
        return self.ops.rms_norm(x, self.weight, self.eps, residual)


class RotaryEmbedding(nn.Module):
    """Rotary position embedding (half-rotation layout, as in Hugging Face Llama) with Llama 3 / linear scaling."""

    def __init__(self, head_dim: int, max_position: int, theta: float, scaling: RopeScaling | None, ops: Ops):
        super().__init__()
        self.ops = ops
        self.shape = (head_dim, max_position, theta, scaling)
        cos, sin = self.tables(torch.device("cpu"))
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def tables(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin of every position's angles, [max_position, head_dim / 2] float32 on ``device``."""
        head_dim, max_position, theta, scaling = self.shape
        # float32 throughout, as the reference implementations do, so angles match them bit for bit.
        # Built on the CPU even under a meta-device context, then moved.
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim))
        if scaling is not None:
            inv_freq = _scale_inv_freq(inv_freq, scaling)
        freqs = torch.outer(torch.arange(max_position, dtype=torch.float32, device="cpu"), inv_freq)
        return freqs.cos().to(device), freqs.sin().to(device)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q: [tokens, heads, head_dim], k: [tokens, kv_heads, head_dim]; may be rotated in place."""
        return self.ops.rotary(q, k, positions, self.cos, self.sin)


def _scale_inv_freq(inv_freq: torch.Tensor, s: RopeScaling) -> torch.Tensor:
    if s.kind == "linear":
        return inv_freq / s.factor
    # Llama 3.1: keep high frequencies, divide low ones by the factor, interpolate smoothly between.
    low_wavelen = s.original_max_position / s.low_freq_factor
    high_wavelen = s.original_max_position / s.high_freq_factor
    wavelen = 2 * torch.pi / inv_freq
    smooth = (s.original_max_position / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
    scaled = torch.where(wavelen > low_wavelen, inv_freq / s.factor, inv_freq)
    middle = (wavelen <= low_wavelen) & (wavelen >= high_wavelen)
    return torch.where(middle, (1 - smooth) * inv_freq / s.factor + smooth * inv_freq, scaled)
