"""Allocating the model's parameters and the KV pool without paying for work nobody needs at start-up."""

from __future__ import annotations

import math
import mmap

import torch


def materialize(model: torch.nn.Module, device: torch.device, dtype: torch.dtype) -> torch.nn.Module:
    """Give a model built on the meta device real, uninitialised storage: floating tensors in ``dtype``.

    ``Module.to_empty`` does the same through ``torch.empty_like`` on meta tensors, whose Python meta kernels
    import sympy and torch's decompositions on first use (1.5 s of a CPU start, measured 2026-12-02); the shapes
    are all that is needed. A tensor shared by two modules (tied embeddings) stays shared.
    """
    # Keyed by the meta tensor's id; the meta tensor is kept in the value so no id is reused while this runs.
    made: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def real(t: torch.Tensor, parameter: bool) -> torch.Tensor:
        if id(t) not in made:
            storage = torch.empty(t.shape, dtype=dtype if t.is_floating_point() else t.dtype, device=device)
            made[id(t)] = (t, torch.nn.Parameter(storage, requires_grad=t.requires_grad) if parameter else storage)
        return made[id(t)][1]

    for module in model.modules():
        for name, param in module._parameters.items():
            if param is not None:
                module._parameters[name] = real(param, parameter=True)  # type: ignore[assignment]
        for name, buffer in module._buffers.items():
            if buffer is not None:
                module._buffers[name] = real(buffer, parameter=False)
    return model


def zeroed_host_tensor(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zero-filled CPU tensor whose pages cost nothing until first written.

    Anonymous memory maps come zero-filled from the kernel, page by page on first touch, so a KV pool sized for
    every block the memory allows is free to allocate and only the blocks requests use are ever paid for;
    ``torch.zeros`` writes every page up front (0.5 s for the default model's 2 GiB pool on this machine).
    """
    count = math.prod(shape)
    buffer = mmap.mmap(-1, max(count * dtype.itemsize, 1))
    return torch.frombuffer(buffer, dtype=dtype, count=count).view(shape)
