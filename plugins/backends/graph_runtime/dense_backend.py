"""The part of a graph-runtime backend that does not depend on the runtime: the flat KV cache, the export, and the
step loop that feeds the dense graph from the engine's paged cache and writes the new K/V back into their slots."""

from __future__ import annotations

import logging
from abc import abstractmethod
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from rtx_plugins.backends.graph_runtime.cache import GraphCache
from rtx_plugins.backends.graph_runtime.dense_step import plan_calls
from rtx_plugins.backends.graph_runtime.exporter import ExportedGraph, ExportSettings, exported_graph
from rtx_plugins.backends.graph_runtime.fp8_qdq import graph_quantization
from rtx_plugins.backends.torch_backend.cpu_tuning import tune_allocator
from rtxcore.contracts.backend import (
    BackendCapabilities,
    BackendOptions,
    ExecutionBackend,
    ForwardBatch,
    default_kv_cache_bytes,
)
from rtxcore.errors import ConfigError
from rtxcore.kv.block_io import read_blocks, write_blocks
from rtxcore.models.config import ModelConfig
from rtxcore.models.source import ModelSource

log = logging.getLogger(__name__)

# Precisions the exported graph's inputs and outputs (and so the KV cache) can have.
DTYPES = {"float32": torch.float32, "float16": torch.float16}
NUMPY_DTYPES = {torch.float32: np.float32, torch.float16: np.float16}
# Share of the GPU's free memory the KV cache takes when no size is configured: less than the torch backend's, to
# leave the runtime room for its own activations and workspace.
_CUDA_KV_FRACTION = 0.5


@dataclass(slots=True)
class GraphOutputs:
    logits: np.ndarray
    present_keys: np.ndarray
    present_values: np.ndarray


def check_options(name: str, caps: BackendCapabilities, device: str, options: BackendOptions) -> str:
    """The dtype to run, after refusing what ``caps`` rules out (a ConfigError naming what would work)."""
    dtype = options.dtype if options.dtype != "auto" else ("float16" if device == "cuda" else "float32")
    if dtype not in caps.dtypes:
        raise ConfigError(f"backend {name!r} cannot run dtype {dtype!r} here (it accepts: {', '.join(caps.dtypes)})")
    if options.kv_cache_dtype not in caps.kv_cache_dtypes:
        raise ConfigError(f"backend {name!r} cannot hold a {options.kv_cache_dtype!r} KV cache (it holds: "
                          f"{', '.join(caps.kv_cache_dtypes)})")
    if caps.max_batch_size is not None and options.max_batch_size > caps.max_batch_size:
        raise ConfigError(f"backend {name!r} runs at most {caps.max_batch_size} requests per step; "
                          f"max_num_seqs is {options.max_batch_size}")
    return dtype


class DenseGraphBackend(ExecutionBackend):
    """Subclasses open the exported graph in their runtime (``_open``) and run one call of it (``_run``)."""

    def __init__(self, options: BackendOptions, device: str, dtype: str, cache: GraphCache | None = None):
        super().__init__(options)
        self._device = torch.device(device)
        if self._device.type == "cpu":
            tune_allocator()  # logits and new K/V come back in fresh buffers every call: reuse their pages
        self.dtype = DTYPES[dtype]
        self._dtype_name = dtype
        self.graph_cache = cache or GraphCache(verify=options.verify_artifact)
        # The export this backend runs; its cache_hit and export_s say what this start cost.
        self.graph: ExportedGraph | None = None
        self._config: ModelConfig | None = None
        self.key_cache = self.value_cache = torch.empty(0)

    @property
    def device(self) -> torch.device:
        return self._device

    @property
    def model_config(self) -> ModelConfig:
        if self._config is None:
            raise RuntimeError("no model loaded")
        return self._config

    def load(self, source: ModelSource, progress: Callable[[int, int], None] | None = None) -> None:
        self._config = source.config
        settings = ExportSettings(self._dtype_name, quantization=graph_quantization(self.options))
        self.graph = exported_graph(source, settings, self.graph_cache, progress)
        try:
            self._open(self.graph)
        except Exception as exc:
            if not self.graph.cache_hit or not self._damaged_graph(exc):
                raise
            # A cached file cut short or damaged on disk (a full disk, a killed copy) would fail every start: a
            # cache entry is only ever a copy of what the weights give, so it is built again.
            log.warning("the cached graph %s does not open (%s); exporting it again", self.graph.path, exc)
            self.graph_cache.discard(self.graph.key)
            self.graph = exported_graph(source, settings, self.graph_cache, progress)
            self._open(self.graph)

    def kv_cache_bytes_per_token(self) -> int:
        return self.model_config.kv_cache_bytes_per_token(self.dtype.itemsize)

    def available_kv_cache_bytes(self) -> int:
        return default_kv_cache_bytes(self._device, _CUDA_KV_FRACTION)

    def allocate_kv_cache(self, num_blocks: int, block_size: int) -> None:
        cfg = self.model_config
        # As the graph gathers it: row layer * num_slots + slot, where slot = block_id * block_size + offset.
        shape = (cfg.num_layers * num_blocks * block_size, cfg.num_kv_heads, cfg.head_dim)
        self.key_cache = torch.zeros(shape, dtype=self.dtype, device=self._device)
        self.value_cache = torch.zeros(shape, dtype=self.dtype, device=self._device)
        self.block_size = block_size

    def read_kv_blocks(self, block_ids: list[int]) -> torch.Tensor:
        return read_blocks(self._blocked_caches(), 1, block_ids)

    def write_kv_blocks(self, block_ids: list[int], data: torch.Tensor) -> None:
        write_blocks(self._blocked_caches(), 1, block_ids, data)

    def _blocked_caches(self) -> list[torch.Tensor]:
        # Views of the flat caches with the block as a dimension: [layers, num_blocks, block_size, heads, head_dim].
        layers = self.model_config.num_layers
        num_blocks = self.key_cache.shape[0] // (layers * self.block_size)
        return [c.view(layers, num_blocks, self.block_size, *c.shape[1:]) for c in (self.key_cache, self.value_cache)]

    @torch.inference_mode()
    def execute(self, batch: ForwardBatch) -> torch.Tensor:
        logits = torch.empty(len(batch.logits_indices), self.model_config.vocab_size)
        for call in plan_calls(batch, NUMPY_DTYPES[self.dtype]):
            out = self._run(call.feeds, self.key_cache, self.value_cache)
            if batch.write_kv:
                slots = batch.slot_mapping[call.first_token:call.end_token].to(self._device)
                self._write(self.key_cache, out.present_keys, call.token_rows, slots)
                self._write(self.value_cache, out.present_values, call.token_rows, slots)
            n = len(call.logits_positions)
            if n:
                logits[call.logits_positions] = torch.from_numpy(out.logits[:n])
        return logits.to(self._device)

    def _write(self, cache: torch.Tensor, present: np.ndarray, token_rows: torch.Tensor, slots: torch.Tensor) -> None:
        layers, b, t = present.shape[:3]
        new = torch.from_numpy(present).reshape(layers, b * t, -1).index_select(1, token_rows)
        # One flat copy along dim 0: index_copy_ along the middle dim of [L, S, ...] is some 30x slower on the CPU.
        slots_per_layer = cache.shape[0] // layers
        rows = (slots[None, :] + torch.arange(layers, device=slots.device)[:, None] * slots_per_layer).reshape(-1)
        entries = new.reshape(-1, new.shape[-1]).to(cache.device, cache.dtype)
        cache.view(cache.shape[0], -1).index_copy_(0, rows, entries)

    def _damaged_graph(self, exc: Exception) -> bool:
        """Whether ``exc``, raised by :meth:`_open`, says the graph file itself is unreadable (and so worth exporting
        again), rather than, say, a missing device or memory."""
        return False

    @abstractmethod
    def _open(self, graph: ExportedGraph) -> None:
        """Prepare the runtime for the exported graph."""

    @abstractmethod
    def _run(self, feeds: dict[str, np.ndarray], key_cache: torch.Tensor, value_cache: torch.Tensor) -> GraphOutputs:
        """Run one call of the graph: ``feeds`` are its inputs other than the cache."""
