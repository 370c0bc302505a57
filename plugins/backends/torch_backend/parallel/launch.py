"""Starting the ranks and holding rank 0's end of them (see the package docstring for the two ways ranks start)."""

from __future__ import annotations

import os
import socket
from dataclasses import replace
from datetime import timedelta
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from rtx_plugins.backends.torch_backend.parallel import messages
from rtxcore.contracts.backend import BackendOptions, ForwardBatch
from rtxcore.errors import ConfigError

if TYPE_CHECKING:
    from multiprocessing.process import BaseProcess

    from rtxcore.models.config import ModelConfig
    from rtxcore.models.source import ModelSource

# How long a collective may wait for a rank before raising, instead of hanging forever on one that is stuck. Loading
# the weights happens between two collectives, so this must cover the slowest rank's load.
COLLECTIVE_TIMEOUT = timedelta(seconds=300)
# How long workers get to leave after the shutdown message before they are terminated.
_JOIN_TIMEOUT_S = 10.0


def check_divisible(cfg: ModelConfig, tp_size: int) -> None:
    """Refuse a size that does not split the model evenly, naming the first dimension it does not divide."""
    for what, size in (("attention heads", cfg.num_heads), ("KV heads", cfg.num_kv_heads),
                       ("intermediate size", cfg.intermediate_size), ("vocabulary size", cfg.vocab_size)):
        if size % tp_size:
            raise ConfigError(f"tensor_parallel_size {tp_size} does not divide the model's {what} ({size})")


def rank_device(device: torch.device, local_rank: int) -> torch.device:
    """Each rank's own GPU on CUDA; every rank shares the CPU."""
    return torch.device("cuda", local_rank) if device.type == "cuda" else device


def launched_by_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


class TensorParallelGroup:
    """Rank 0's end of the ranks: sends them each command, and notices when one of the workers it spawned died."""

    def __init__(self, device: torch.device, workers: list[BaseProcess]):
        self.device = device
        self._workers = workers
        self._closed = False

    def allocate_kv_cache(self, num_blocks: int, block_size: int) -> None:
        self._check_workers()
        messages.send_command(messages.Command.ALLOCATE_KV, num_blocks, block_size, device=self.device)

    def execute(self, batch: ForwardBatch) -> None:
        # A dead peer usually fails the next collective at once (its socket closes); checking first also names it.
        self._check_workers()
        messages.send_batch(batch, self.device)

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            if all(w.exitcode is None for w in self._workers):
                messages.send_command(messages.Command.SHUTDOWN, device=self.device)
        except RuntimeError:  # a worker already gone: the ones left are terminated below
            pass
        for w in self._workers:
            w.join(_JOIN_TIMEOUT_S)
            if w.exitcode is None:
                w.terminate()
                w.join(_JOIN_TIMEOUT_S)
        dist.destroy_process_group()

    def _check_workers(self) -> None:
        for rank, w in enumerate(self._workers, start=1):
            if w.exitcode is not None:
                raise RuntimeError(f"tensor-parallel worker rank {rank} (pid {w.pid}) exited with code {w.exitcode}")


def start(options: BackendOptions, source: ModelSource, device: torch.device) -> TensorParallelGroup:
    """Join the ranks as rank 0, spawning the workers unless torchrun started them.

    Under torchrun, on any other rank this runs that rank's worker until rank 0 shuts down, then exits the process.
    """
    tp_size = options.tensor_parallel_size
    backend = "nccl" if device.type == "cuda" else "gloo"
    if launched_by_torchrun():
        rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        if world_size != tp_size:
            raise ConfigError(f"torchrun started {world_size} ranks, but tensor_parallel_size is {tp_size}")
        local_rank = int(os.environ.get("LOCAL_RANK", rank))
        dist.init_process_group(backend, init_method="env://", rank=rank, world_size=world_size,
                                timeout=COLLECTIVE_TIMEOUT)
        if rank != 0:
            # Imported here: the worker imports this module (and the backend, which imports this module too).
            from rtx_plugins.backends.torch_backend.parallel import worker

            worker.serve(rank, worker_options(options, device, local_rank), source)
            dist.destroy_process_group()
            raise SystemExit(0)
        return TensorParallelGroup(rank_device(device, local_rank), [])
    init_method = f"tcp://{os.environ.get('MASTER_ADDR', '127.0.0.1')}:{os.environ.get('MASTER_PORT') or _free_port()}"
    from rtx_plugins.backends.torch_backend.parallel import worker  # see above: imported late, to avoid a cycle

    # Spawned, not forked: a forked child would inherit rank 0's threads and CUDA state.
    ctx = mp.get_context("spawn")
    workers = []
    for rank in range(1, tp_size):
        # Daemonic: if rank 0 dies without shutting them down, they go with it.
        w = ctx.Process(target=worker.main, daemon=True, name=f"rtx-tp-rank{rank}",
                        args=(rank, tp_size, backend, init_method, worker_options(options, device, rank), source))
        w.start()
        workers.append(w)
    try:
        dist.init_process_group(backend, init_method=init_method, rank=0, world_size=tp_size,
                                timeout=COLLECTIVE_TIMEOUT)
    except BaseException:
        for w in workers:
            w.terminate()
        raise
    return TensorParallelGroup(rank_device(device, 0), workers)


def worker_options(options: BackendOptions, device: torch.device, local_rank: int) -> BackendOptions:
    # verify_artifact may be a closure over the server's state, which does not pickle; workers build no artifacts.
    return replace(options, device=str(rank_device(device, local_rank)), verify_artifact=None)


def _free_port() -> int:
    # Another process may take it before rank 0 binds it again; rare on one node, and init then fails loudly.
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
