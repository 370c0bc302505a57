"""Host-to-device copies that do not stall the host: a blocking copy from ordinary (pageable) memory waits until
the device has finished all queued work, the forward pass included; from pinned memory it is queued behind that work
and the host goes on."""

from __future__ import annotations

from typing import Any

import torch


def release_device_memory() -> None:
    """Give a released model's device memory back before the next one allocates (the collector first: a backend
    and its CUDA graphs or hooks refer to each other)."""
    import gc

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def to_device_async(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``t`` (on the host) on ``device``; a copy to an accelerator is queued without waiting."""
    if device.type == "cpu" or t.device.type != "cpu":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


def to_device(data: Any, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A tensor built from Python data on the host, then queued for copying to ``device`` without waiting."""
    accelerated = device.type != "cpu"
    return torch.tensor(data, dtype=dtype, pin_memory=accelerated).to(device, non_blocking=accelerated)
