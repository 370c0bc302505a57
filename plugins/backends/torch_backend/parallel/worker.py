"""A worker rank: its shard of the model and of the KV cache, running whatever rank 0 sends until told to stop."""

from __future__ import annotations

import signal
from typing import TYPE_CHECKING

import torch.distributed as dist

from rtx_plugins.backends.torch_backend.parallel import launch, messages
from rtxcore.contracts.backend import BackendOptions

if TYPE_CHECKING:
    from rtxcore.models.source import ModelSource


def main(rank: int, world_size: int, backend: str, init_method: str, options: BackendOptions,
         source: ModelSource) -> None:
    """Entry point of a spawned worker process."""
    # Ctrl-C reaches the whole process group; rank 0 alone decides when its workers stop (SHUTDOWN, or its exit
    # closing their connections), so they do not die with a traceback each first.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size,
                            timeout=launch.COLLECTIVE_TIMEOUT)
    try:
        serve(rank, options, source)
    finally:
        dist.destroy_process_group()


def serve(rank: int, options: BackendOptions, source: ModelSource) -> None:
    """Load this rank's shard, then run commands until SHUTDOWN. A collective that fails raises out of here."""
    from rtx_plugins.backends.torch_backend.backend import TorchBackend

    launch.check_setup(rank, options, source)
    backend = TorchBackend(options, rank=rank)
    backend.load(source)
    device = backend.device
    while True:
        header = messages.receive_header(device)
        command = messages.Command(header[0])
        if command is messages.Command.SHUTDOWN:
            return
        if command is messages.Command.ALLOCATE_KV:
            backend.allocate_kv_cache(header[1], header[2])
        else:
            # The logits are rank 0's; this rank takes part in computing them (the vocabulary-parallel LM head) or
            # in the hidden states they come from (a pipeline stage).
            backend.run_step(*messages.receive_batch(header, device))
