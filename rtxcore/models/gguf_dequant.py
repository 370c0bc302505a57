"""GGUF tensor data to float32: the common legacy block formats in torch, everything else through ``gguf.quants``.

``gguf.quants.dequantize`` walks a tensor in small groups of rows (to bound numpy's temporaries), which costs
1.7 s for the default model's Q4_1 weights on this machine's CPU; the same arithmetic over whole tensors in torch
(all cores, no per-group overhead) takes a tenth of that (measured 2026-12-02). Values are bit-identical: the same
float32 products and sums, in the same order, as the library's ``dequantize_blocks``.
"""

from __future__ import annotations

import warnings

import numpy as np
import torch
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize

# Formats whose block is [f16 scale, (f16 minimum,) packed quants]; block size 32 for all three.
_FAST = (GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1, GGMLQuantizationType.Q8_0)


def dequantize(data: np.ndarray, kind: GGMLQuantizationType, shape: tuple[int, ...]) -> torch.Tensor:
    """A float32 tensor of ``shape`` (PyTorch order) from a GGUF tensor's ``data`` (see ``GGUFTensor``).

    :raises NotImplementedError: the format cannot be dequantized (from ``gguf.quants``).
    """
    if kind in _FAST:
        return _legacy_blocks(data, kind).reshape(shape)
    values = np.asarray(gguf_dequantize(data, kind), dtype=np.float32).reshape(shape)
    if not values.flags.writeable:  # plain F32 data is a view of the read-only memory map
        values = values.copy()
    return torch.from_numpy(np.ascontiguousarray(values))


def _legacy_blocks(data: np.ndarray, kind: GGMLQuantizationType) -> torch.Tensor:
    _, type_size = GGML_QUANT_SIZES[kind]
    with warnings.catch_warnings():
        # The memory map is read-only; nothing here writes to it (every op below makes a new tensor).
        warnings.simplefilter("ignore", UserWarning)
        blocks = torch.from_numpy(data.reshape(-1, type_size))
    scale = blocks[:, 0:2].contiguous().view(torch.float16).float()
    if kind == GGMLQuantizationType.Q8_0:
        return blocks[:, 2:].contiguous().view(torch.int8).float() * scale
    offset = 4 if kind == GGMLQuantizationType.Q4_1 else 2
    packed = blocks[:, offset:]
    half = packed.shape[1]
    # Low nibbles are the block's first half, high nibbles its second half; in-place ops keep it to few passes.
    out = torch.empty(packed.shape[0], 2 * half)
    out[:, :half] = packed & 0x0F
    out[:, half:] = packed >> 4
    if kind == GGMLQuantizationType.Q4_0:
        return out.sub_(8).mul_(scale)  # (q - 8) is exact in float32, as the library's int8 subtraction
    minimum = blocks[:, 2:4].contiguous().view(torch.float16).float()
    return out.mul_(scale).add_(minimum)
