"""Host-to-device copies that do not stall the host."""

from __future__ import annotations

import torch


def to_device_async(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``t`` (on the host) on ``device``; a copy to an accelerator is queued without waiting.

    From pageable memory a copy waits until the device has finished all queued work; from pinned memory it is
    queued behind that work and the host goes on.
    """
    if device.type == "cpu" or t.device.type != "cpu":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)
