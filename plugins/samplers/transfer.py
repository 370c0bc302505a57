"""Host-to-device copies that leave the host free to run ahead of the device."""

from __future__ import annotations

from typing import Any

import torch


def to_device(data: Any, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A tensor built from Python data on the host, then queued for copying to ``device``.

    A blocking copy from ordinary (pageable) memory waits until the device has finished all queued work, the
    forward pass included; from pinned memory the copy is queued behind that work and the host goes on.
    """
    accelerated = device.type != "cpu"
    return torch.tensor(data, dtype=dtype, pin_memory=accelerated).to(device, non_blocking=accelerated)


def move(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """:func:`to_device` for a tensor already on the host."""
    if tensor.device.type == "cpu" and device.type != "cpu":
        return tensor.pin_memory().to(device, non_blocking=True)
    return tensor.to(device)
