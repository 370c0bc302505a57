"""Starting the ranks and holding rank 0's end of them (see the package docstring for the two ways ranks start)."""

from __future__ import annotations

import os
import socket
import time
from dataclasses import replace
from datetime import timedelta
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from rtx_plugins.backends.torch_backend.layers import ParallelContext
from rtx_plugins.backends.torch_backend.parallel import messages
from rtxcore.contracts.backend import BackendOptions, ForwardBatch
from rtxcore.errors import ConfigError, EngineFailed

if TYPE_CHECKING:
    from multiprocessing.process import BaseProcess

    from rtxcore.models.config import ModelConfig
    from rtxcore.models.source import ModelSource

# How long a collective may wait for a rank before raising, instead of hanging forever on one that is stuck. Loading
# the weights happens between two collectives, so this must cover the slowest rank's load.
COLLECTIVE_TIMEOUT = timedelta(seconds=300)
# How long workers get to leave after the shutdown message before they are terminated.
_JOIN_TIMEOUT_S = 10.0


def check_divisible(cfg: ModelConfig, tp_size: int, pp_size: int) -> None:
    """Refuse sizes that do not split the model evenly, naming the first dimension one does not divide."""
    for what, size in (("attention heads", cfg.num_heads), ("KV heads", cfg.num_kv_heads),
                       ("intermediate size", cfg.intermediate_size), ("vocabulary size", cfg.vocab_size)):
        if size % tp_size:
            raise ConfigError(f"tensor_parallel_size {tp_size} does not divide the model's {what} ({size})")
    if cfg.num_layers % pp_size:
        raise ConfigError(f"pipeline_parallel_size {pp_size} does not divide the model's layers ({cfg.num_layers})")


def check_devices(device: torch.device, world_size: int) -> None:
    """Refuse more ranks than this node has GPUs (one GPU per rank); CPU ranks share the host."""
    if device.type == "cuda" and world_size > torch.cuda.device_count():
        raise ConfigError(f"tensor_parallel_size x pipeline_parallel_size is {world_size} ranks, one GPU each, but "
                          f"only {torch.cuda.device_count()} CUDA devices are visible")


def parallel_context(rank: int, tp_size: int, pp_size: int) -> ParallelContext:
    """Where global ``rank`` sits, with its stage's process group. Every rank must call this, in step: making a
    process group is a collective over the whole world.

    Ranks are stage-major: stage s holds ranks ``s * tp_size ... s * tp_size + tp_size - 1``, so the ranks of one
    stage (which all-reduce every layer) are neighbours, on one node when the stages span several.
    """
    pp_rank, tp_rank = divmod(rank, tp_size)
    tp_group = None  # one stage: its tensor-parallel group is the whole world (the default group)
    if pp_size > 1 and tp_size > 1:
        for stage in range(pp_size):
            group = dist.new_group(list(range(stage * tp_size, (stage + 1) * tp_size)))
            if stage == pp_rank:
                tp_group = group
    return ParallelContext(tp_rank, tp_size, pp_rank, pp_size, tp_group)


def rank_device(device: torch.device, local_rank: int) -> torch.device:
    """Each rank's own GPU on CUDA; every rank shares the CPU."""
    return torch.device("cuda", local_rank) if device.type == "cuda" else device


def launched_by_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


class ParallelRanks:
    """Rank 0's end of the other ranks: sends them each command, and notices when a worker it spawned died."""

    def __init__(self, device: torch.device, workers: list[BaseProcess]):
        self.device = device
        self._workers = workers
        self._closed = False

    def allocate_kv_cache(self, num_blocks: int, block_size: int) -> None:
        self.check_workers()
        messages.send_command(messages.Command.ALLOCATE_KV, num_blocks, block_size, device=self.device)

    def execute(self, batch: ForwardBatch, num_micro_batches: int) -> None:
        # A dead peer usually fails the next collective at once (its socket closes); checking first also names it.
        self.check_workers()
        messages.send_batch(batch, num_micro_batches, self.device)

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

    def check_workers(self, grace_s: float = 0.0) -> None:
        """Raise naming the first worker this process spawned that has exited, waiting up to ``grace_s`` for one
        to (a peer's socket closes while it is still exiting: the collective fails before its exit code is in)."""
        deadline = time.monotonic() + grace_s
        while True:
            for rank, w in enumerate(self._workers, start=1):
                if w.exitcode is not None:  # nothing in this process will step again: not a fault to retry
                    raise EngineFailed(f"parallel worker rank {rank} (pid {w.pid}) exited with code {w.exitcode}")
            if time.monotonic() >= deadline:
                return
            time.sleep(0.05)


def world_size(options: BackendOptions) -> int:
    return options.tensor_parallel_size * options.pipeline_parallel_size


def start(options: BackendOptions, source: ModelSource, device: torch.device) -> ParallelRanks:
    """Join the ranks as rank 0, spawning this node's workers unless torchrun started them.

    Under torchrun, on any other rank this runs that rank's worker until rank 0 shuts down, then exits the process.
    On a node other than the first (``options.node_rank > 0``) this spawns that node's ranks, waits until they end,
    and exits the process with the worst of their exit codes.
    """
    size = world_size(options)
    backend = "nccl" if device.type == "cuda" else "gloo"
    if launched_by_torchrun():
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        if world != size:
            raise ConfigError(f"torchrun started {world} ranks, but tensor_parallel_size x pipeline_parallel_size "
                              f"is {size}")
        local_rank = int(os.environ.get("LOCAL_RANK", rank))
        dist.init_process_group(backend, init_method="env://", rank=rank, world_size=world,
                                timeout=COLLECTIVE_TIMEOUT)
        if rank != 0:
            # Imported here: the worker imports this module (and the backend, which imports this module too).
            from rtx_plugins.backends.torch_backend.parallel import worker

            worker.serve(rank, worker_options(options, device, local_rank), source)
            dist.destroy_process_group()
            raise SystemExit(0)
        announce_setup(options, source)
        return ParallelRanks(rank_device(device, local_rank), [])
    nodes, node_rank = options.nnodes, options.node_rank
    per_node = size // nodes  # EngineConfig checked that the nodes divide the ranks
    check_devices(device, per_node)
    if options.dist_init_addr:
        init_method = f"tcp://{options.dist_init_addr}"
    else:
        port = os.environ.get("MASTER_PORT") or _free_port()
        init_method = f"tcp://{os.environ.get('MASTER_ADDR', '127.0.0.1')}:{port}"
    from rtx_plugins.backends.torch_backend.parallel import worker  # see above: imported late, to avoid a cycle

    # Spawned, not forked: a forked child would inherit rank 0's threads and CUDA state.
    ctx = mp.get_context("spawn")
    workers = []
    first = node_rank * per_node
    for rank in range(max(first, 1), first + per_node):
        # Daemonic: if rank 0 (or this node's launcher) dies without shutting them down, they go with it.
        w = ctx.Process(target=worker.main, daemon=True, name=f"rtx-rank{rank}",
                        args=(rank, size, backend, init_method, worker_options(options, device, rank - first), source))
        w.start()
        workers.append(w)
    if node_rank > 0:
        # Another node's launcher: its ranks serve rank 0 until it shuts down; then this process is done.
        for w in workers:
            w.join()
        raise SystemExit(max((w.exitcode or 0) for w in workers))
    try:
        dist.init_process_group(backend, init_method=init_method, rank=0, world_size=size,
                                timeout=COLLECTIVE_TIMEOUT)
    except BaseException:
        for w in workers:
            w.terminate()
        raise
    announce_setup(options, source)
    return ParallelRanks(rank_device(device, 0), workers)


def setup_fingerprint(options: BackendOptions, source: ModelSource) -> str:
    """What every rank must agree on: the model's shape, the dtype and the parallel sizes."""
    return (f"{source.config!r} dtype={options.dtype} kv_cache_dtype={options.kv_cache_dtype} "
            f"quantizer={type(options.quantizer).__name__} "
            f"tp={options.tensor_parallel_size} pp={options.pipeline_parallel_size}")


def announce_setup(options: BackendOptions, source: ModelSource) -> None:
    """Rank 0's half of :func:`check_setup`."""
    dist.broadcast_object_list([setup_fingerprint(options, source)], src=0)


def check_setup(rank: int, options: BackendOptions, source: ModelSource) -> None:
    """Refuse to serve a rank 0 that loads another model or other sizes (another node started with other flags):
    its steps would not fit this rank's weights."""
    theirs: list[object] = [None]
    dist.broadcast_object_list(theirs, src=0)
    ours = setup_fingerprint(options, source)
    if theirs[0] != ours:
        raise ConfigError(f"rank {rank} was started with another model or other settings than rank 0: rank 0 has "
                          f"{theirs[0]}; this rank has {ours}")


def worker_options(options: BackendOptions, device: torch.device, local_rank: int) -> BackendOptions:
    # verify_artifact may be a closure over the server's state, which does not pickle; workers build no artifacts.
    return replace(options, device=str(rank_device(device, local_rank)), verify_artifact=None)


def _free_port() -> int:
    # Another process may take it before rank 0 binds it again; rare on one node, and init then fails loudly.
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
