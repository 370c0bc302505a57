"""Engine settings: which plugins to use and how big the KV cache and batches are."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from rtxcore.contracts.scheduler import SchedulerConfig
from rtxcore.engine.speculation.config import SpeculativeConfig
from rtxcore.errors import ConfigError
from rtxcore.files import check_directory_path


@dataclass(slots=True)
class EngineConfig:
    # None or "smollm2-135m" for the default model; a .gguf file, a Hugging Face directory or "dummy:<shape>".
    model: str | None = None
    # A Hugging Face Hub id's branch, tag or commit (default: main).
    revision: str | None = None
    backend: str = "torch"
    scheduler: str = "fcfs"
    sampler: str = "default"
    eviction_policy: str = "lru"
    # Quantizer plugin applied to linear weights at load, or None.
    quantization: str | None = None
    device: str = "auto"
    dtype: str = "auto"
    # Ranks the model's layers are split across (Megatron-style tensor parallelism, one node); 1 runs unsplit.
    tensor_parallel_size: int = 1
    # Stages the decoder layers are split across (pipeline parallelism); the world is tensor x pipeline ranks.
    pipeline_parallel_size: int = 1
    # Several nodes: this process's node among nnodes, and rank 0's rendezvous "host:port" (every node's ranks
    # connect there). Node 0 runs the engine; any other node only runs its share of the ranks.
    nnodes: int = 1
    node_rank: int = 0
    dist_init_addr: str | None = None
    # Jinja chat template text used instead of the model's own (--chat-template FILE); None: the model's.
    chat_template: str | None = None
    # Tokens per KV block.
    block_size: int = 16
    # KV blocks to allocate; None sizes the cache from kv_cache_bytes or what the backend can spare.
    num_kv_blocks: int | None = None
    kv_cache_bytes: int | None = None
    # Longest sequence (prompt + output) accepted; None uses the model's context length.
    max_model_len: int | None = None
    enable_prefix_caching: bool = True
    # Lower KV tiers (rtxcore.kv.tiers): prefix-cache blocks the device evicts go to host memory (this many bytes;
    # 0 for none), then to files under kv_disk_dir (at most kv_disk_bytes), and come back on a prefix hit.
    kv_host_bytes: int = 0
    kv_disk_dir: str | None = None
    kv_disk_bytes: int = 8 << 30
    # Eviction policies of the host and disk tiers; None uses eviction_policy.
    kv_host_eviction_policy: str | None = None
    kv_disk_eviction_policy: str | None = None
    # With kv_disk_dir: write the prefix cache (device and host blocks) and its index there this often, so a
    # restart starts warm; 0 only on shutdown (EngineCore.save_kv_snapshot).
    kv_snapshot_interval_s: float = 60.0
    # Never capture CUDA graphs; every step runs eagerly.
    enforce_eager: bool = False
    # See BackendOptions.kv_cache_dtype ("auto" or "fp8").
    kv_cache_dtype: str = "auto"
    # Schedule step N+1 while the device computes step N, feeding it step N's tokens on the device; outputs then
    # come back one step later. None: on for accelerators, off on the CPU (where there is nothing to overlap).
    async_scheduling: bool | None = None
    scheduling: SchedulerConfig = field(default_factory=SchedulerConfig)
    # Speculative decoding (a proposer for every request, or only requests that bring their own tokens).
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)
    # Settings of the logits processors, by processor name (``--logits-processor-option NAME.KEY=VALUE``, the
    # config file's ``[logits_processors.NAME]``); each processor takes the options its describe() lists.
    logits_processor_options: dict[str, dict[str, Any]] = field(default_factory=dict)
    # See BackendOptions.verify_artifact: set by a server that checks signed models.
    verify_artifact: Callable[[Path], object] | None = None

    @property
    def world_size(self) -> int:
        """Processes that run the model together: one per tensor-parallel rank of every pipeline stage."""
        return self.tensor_parallel_size * self.pipeline_parallel_size

    def _check_nodes(self) -> None:
        if self.nnodes < 1 or not 0 <= self.node_rank < self.nnodes:
            raise ConfigError(f"node_rank must be in 0..nnodes-1 and nnodes at least 1, got node_rank "
                              f"{self.node_rank} of nnodes {self.nnodes}")
        if self.world_size % self.nnodes:
            raise ConfigError(f"nnodes {self.nnodes} does not divide the {self.world_size} ranks "
                              f"(tensor_parallel_size x pipeline_parallel_size): every node runs as many")
        if self.nnodes > 1 and not self.dist_init_addr:
            raise ConfigError("nnodes above 1 needs dist_init_addr, the host:port of node 0 where the ranks meet")
        if self.dist_init_addr:
            host, _, port = self.dist_init_addr.rpartition(":")
            if not host or not port.isdigit() or not 0 < int(port) < 65536:
                raise ConfigError(f"dist_init_addr {self.dist_init_addr!r} is not host:port")

    def __post_init__(self) -> None:
        if self.tensor_parallel_size < 1:
            raise ConfigError(f"tensor_parallel_size must be at least 1, got {self.tensor_parallel_size}")
        if self.pipeline_parallel_size < 1:
            raise ConfigError(f"pipeline_parallel_size must be at least 1, got {self.pipeline_parallel_size}")
        self._check_nodes()
        if self.world_size > 1 and (self.kv_host_bytes or self.kv_disk_dir):
            raise ConfigError("KV tiers (kv_host_bytes, kv_disk_dir) are not supported with tensor or pipeline "
                              "parallelism yet")
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ConfigError(f"block_size must be a power of two, got {self.block_size}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 2:
            raise ConfigError(f"num_kv_blocks must be at least 2, got {self.num_kv_blocks}")
        if self.kv_cache_bytes is not None and self.kv_cache_bytes <= 0:
            raise ConfigError(f"kv_cache_bytes must be positive, got {self.kv_cache_bytes}")
        if self.kv_host_bytes < 0 or self.kv_disk_bytes <= 0:
            raise ConfigError("kv_host_bytes must be >= 0 and kv_disk_bytes positive")
        if self.kv_snapshot_interval_s < 0:
            raise ConfigError(f"kv_snapshot_interval_s must be >= 0, got {self.kv_snapshot_interval_s}")
        if self.kv_disk_dir:
            check_directory_path(self.kv_disk_dir, "kv_disk_dir")
        if (self.kv_host_bytes or self.kv_disk_dir) and not self.enable_prefix_caching:
            raise ConfigError("KV offload (kv_host_bytes, kv_disk_dir) keeps prefix-cache blocks: it needs prefix "
                              "caching on")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ConfigError(f"max_model_len must be positive, got {self.max_model_len}")
