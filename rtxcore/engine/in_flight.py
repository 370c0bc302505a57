"""A launched step whose sampled tokens are still on their way to the host (asynchronous scheduling)."""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

import torch

from rtxcore.contracts.sampler import SamplerOutput
from rtxcore.request import Request


@dataclass(slots=True)
class InFlightStep:
    # The requests that sampled, in row order.
    reqs: list[Request]
    # The sampled tokens where the sampler left them: the next step's inputs are taken from here on the device.
    token_ids: torch.Tensor
    # Host copies of the sampler's output, complete once ``ready`` has fired.
    host: SamplerOutput
    ready: torch.cuda.Event | None

    @classmethod
    def launch(cls, reqs: list[Request], sampled: SamplerOutput, inputs: torch.Tensor) -> InFlightStep:
        """Queue the copies of ``sampled`` to pinned host memory behind the step's work, without waiting;
        ``inputs``: the token ids the next step takes (``sampled.token_ids``, or a copy without marks).

        Reading a device tensor later (``.tolist()``) would queue its copy behind whatever the device was given
        in between, the next step's forward pass included; copied now, the host waits for this step alone.
        """
        device = sampled.token_ids.device
        if device.type == "cpu":
            return cls(reqs, inputs, sampled, None)
        copies = {}
        for f in fields(SamplerOutput):
            t = getattr(sampled, f.name)
            if t is not None:
                copies[f.name] = torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t, non_blocking=True)
        ready = torch.cuda.Event()
        ready.record()
        return cls(reqs, inputs, replace(sampled, **copies), ready)

    def wait(self) -> SamplerOutput:
        if self.ready is not None:
            self.ready.synchronize()
        return self.host


def select_rows(out: SamplerOutput, rows: list[int]) -> SamplerOutput:
    """The rows ``rows`` of every tensor of ``out`` (host tensors)."""
    index = torch.tensor(rows, dtype=torch.long)
    return replace(out, **{f.name: getattr(out, f.name)[index] for f in fields(SamplerOutput)
                           if getattr(out, f.name) is not None})
