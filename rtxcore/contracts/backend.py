"""Execution-backend contract: run the model's forward pass over a batch laid out for a paged KV cache.

The batch description is plain tensors (token ids, positions, block tables, slot mapping), so an in-process torch
model can read and write its paged cache directly while a graph runtime (ONNX Runtime, TensorRT) can gather the
blocks into its own inputs and scatter the new entries back.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import torch

if TYPE_CHECKING:
    from rtxcore.contracts.quantizer import Quantizer
    from rtxcore.models.config import ModelConfig
    from rtxcore.models.source import ModelSource


@dataclass(frozen=True, slots=True)
class BackendCapabilities:
    # Devices the backend can run on ("cpu", "cuda").
    devices: tuple[str, ...]
    # Compute dtypes it accepts ("float32", "bfloat16", ...).
    dtypes: tuple[str, ...]
    # Whether it reads and writes the engine's paged KV cache (prefix caching needs it).
    paged_kv: bool
    # Quantization methods whose weights it can run; ANY_QUANTIZATION: any quantizer plugin's (through its linear()).
    quantization_formats: tuple[str, ...] = ()
    # Whether it can copy KV blocks out and back in (read_kv_blocks / write_kv_blocks), which KV tiers need.
    kv_offload: bool = False
    # Whether it can run a subset of the decoder's layers (execute_layers), which self-speculation needs.
    layer_subset: bool = False
    # Whether it can split the model across ranks (BackendOptions.tensor_parallel_size > 1).
    tensor_parallel: bool = False
    # Whether it can split the layers into stages on several ranks (BackendOptions.pipeline_parallel_size > 1).
    pipeline_parallel: bool = False
    # KV cache dtypes it can hold (BackendOptions.kv_cache_dtype): "auto" is the compute dtype.
    kv_cache_dtypes: tuple[str, ...] = ("auto",)
    # Largest batch (requests per step) it can run; None for no limit of its own.
    max_batch_size: int | None = None
    # False when a runtime it needs is missing; ``unavailable_reason`` then says why.
    available: bool = True
    unavailable_reason: str | None = None

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


ANY_QUANTIZATION = "*"


def runs_quantization(caps: BackendCapabilities, method: str) -> bool:
    return method in caps.quantization_formats or ANY_QUANTIZATION in caps.quantization_formats


@dataclass(slots=True)
class BackendOptions:
    # "auto" picks cuda when present, else cpu.
    device: str = "auto"
    # "auto" picks bfloat16 on cuda and float32 on cpu.
    dtype: str = "auto"
    # Weight quantizer applied to the float weights as they load, or None for the checkpoint's precision.
    quantizer: Quantizer | None = None
    # Most requests in one step and longest sequence: backends that prepare per-shape work (CUDA graphs) size it
    # from these.
    max_batch_size: int = 256
    max_model_len: int | None = None
    # Run every step eagerly (no CUDA graphs): slower, but easier to debug and profile.
    enforce_eager: bool = False
    # The KV cache's dtype: "auto" holds K/V in the compute dtype; "fp8" in e4m3, unscaled (half a bfloat16
    # cache's bytes, so twice the blocks and half the attention's reads, at some accuracy: docs/benchmarks.md).
    kv_cache_dtype: str = "auto"
    # Set when the server checks signed models: called on a directory of files derived from the weights and kept
    # between runs (an exported graph, a built engine) before it is reused; raises RtxError to refuse it, and the
    # backend then rebuilds it from the verified weights.
    verify_artifact: Callable[[Path], object] | None = None
    # The quantizers that run a pre-quantized checkpoint's layers, by method name (the checkpoint's methods).
    quantizers: dict[str, Quantizer] = field(default_factory=dict)
    # Ranks the model is split across (tensor parallelism); the backend starts and drives the other ranks itself.
    tensor_parallel_size: int = 1
    # Stages the layers are split across (pipeline parallelism), each stage tensor_parallel_size ranks.
    pipeline_parallel_size: int = 1
    # Several nodes (see EngineConfig): this process's node, how many, and where the ranks meet ("host:port").
    nnodes: int = 1
    node_rank: int = 0
    dist_init_addr: str | None = None


@dataclass(slots=True)
class ForwardBatch:
    # Token ids of every scheduled token, request after request: [num_tokens] int64.
    input_ids: torch.Tensor
    # Position of each token in its sequence: [num_tokens] int64.
    positions: torch.Tensor
    # Where each request's tokens start in ``input_ids``, with the total at the end (host list, num_reqs + 1).
    query_start_loc: list[int]
    # Each request's context length once this step's tokens are in (host list, num_reqs).
    seq_lens: list[int]
    # KV block ids of each request, padded with 0 past its last block: [num_reqs, max_num_blocks] int32.
    block_tables: torch.Tensor
    # Cache slot (block_id * block_size + offset) where each new token's K and V go: [num_tokens] int64.
    slot_mapping: torch.Tensor
    # Rows of ``input_ids`` whose logits are wanted (each sampling request's last token): [num_logits] int64.
    logits_indices: torch.Tensor
    block_size: int = 16
    # Requests in the batch with exactly one new token, placed first by the batch builder.
    num_decodes: int = 0
    # False for work that must leave the KV cache untouched (embeddings): nothing is written to the slots.
    write_kv: bool = True
    extras: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def prefill(cls, token_ids: list[int], block_ids: list[int], block_size: int,
                logits_indices: torch.Tensor) -> ForwardBatch:
        """One sequence's whole prompt as one step, its KV written to ``block_ids`` in order."""
        n = len(token_ids)
        slots = [block_ids[p // block_size] * block_size + p % block_size for p in range(n)]
        return cls(input_ids=torch.tensor(token_ids, dtype=torch.int64), positions=torch.arange(n, dtype=torch.int64),
                   query_start_loc=[0, n], seq_lens=[n], block_tables=torch.tensor([block_ids], dtype=torch.int32),
                   slot_mapping=torch.tensor(slots, dtype=torch.int64), logits_indices=logits_indices,
                   block_size=block_size)

    @property
    def num_reqs(self) -> int:
        return len(self.seq_lens)

    @property
    def num_tokens(self) -> int:
        return self.query_start_loc[-1]


# KV cache size on the CPU when none is configured: room for a few thousand tokens of a small model.
DEFAULT_CPU_KV_CACHE_BYTES = 2 << 30


def default_kv_cache_bytes(device: torch.device, cuda_fraction: float) -> int:
    """What a backend can give its KV cache when no size is configured: ``cuda_fraction`` of the GPU's free memory
    (the rest is the runtime's, for activations and workspace), or a fixed size on the CPU."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free * cuda_fraction)
    return DEFAULT_CPU_KV_CACHE_BYTES


class ExecutionBackend(ABC):
    """Loads a model and runs forward passes; one instance per engine."""

    def __init__(self, options: BackendOptions):
        self.options = options

    @classmethod
    @abstractmethod
    def capabilities(cls) -> BackendCapabilities:
        """What this backend supports here, including whether it can run at all (without instantiating it)."""

    @classmethod
    def describe(cls) -> dict[str, Any]:
        """What ``rtx plugins list`` shows: the capabilities, by default."""
        return cls.capabilities().as_dict()

    @abstractmethod
    def load(self, source: ModelSource, progress: Callable[[int, int], None] | None = None) -> None:
        """Build the model and load its weights, calling ``progress(done, total)`` as weights arrive.

        Raises :class:`~rtxcore.errors.ModelLoadError` on failure."""

    @property
    @abstractmethod
    def model_config(self) -> ModelConfig:
        """The loaded model's shape."""

    @property
    @abstractmethod
    def device(self) -> torch.device:
        """Where logits come back."""

    @abstractmethod
    def kv_cache_bytes_per_token(self) -> int:
        """Bytes of KV cache one token takes across all layers."""

    @abstractmethod
    def available_kv_cache_bytes(self) -> int:
        """Bytes the backend can give to the KV cache on its device when no size is configured."""

    @abstractmethod
    def allocate_kv_cache(self, num_blocks: int, block_size: int) -> None:
        """Preallocate the paged KV cache: ``num_blocks`` blocks of ``block_size`` tokens."""

    @abstractmethod
    def execute(self, batch: ForwardBatch) -> torch.Tensor:
        """Run one step: write the new tokens' K/V into their slots and return logits [num_logits, vocab_size]."""

    def recover(self) -> None:
        """Free what a failed :meth:`execute` may have left behind, before the engine retries the step once (see
        :mod:`rtxcore.engine.faults`). The default hands PyTorch's cached device memory back, which is what an
        out-of-memory failure needs; a backend holding more state (captured graphs, a runtime session) resets it."""
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def execute_layers(self, batch: ForwardBatch, layers: Sequence[int]) -> torch.Tensor:
        """Like :meth:`execute`, through the decoder layers ``layers`` only (increasing indices), then the final
        norm and the LM head: the model drafting for itself (self-speculation, early exit). Writes only those layers'
        K/V. Needed for ``capabilities().layer_subset``."""
        raise NotImplementedError(f"backend {type(self).__name__} cannot run a subset of the model's layers")

    def read_kv_blocks(self, block_ids: list[int]) -> torch.Tensor:
        """The K and V of every layer for each block, as bytes: uint8 [len(block_ids), block_bytes] with
        ``block_bytes = kv_cache_bytes_per_token() * block_size``, in the backend's own layout, on the host or on
        the backend's device (copied out on the same stream, without waiting). The bytes must reflect every step
        already submitted (the engine spills a block just before reusing it). Needed for KV tiers
        (``capabilities().kv_offload``)."""
        raise NotImplementedError(f"backend {type(self).__name__} cannot copy KV blocks out")

    def write_kv_blocks(self, block_ids: list[int], data: torch.Tensor) -> None:
        """Put back blocks :meth:`read_kv_blocks` returned into ``block_ids`` before any later step reads them;
        ``data`` may be on the host or on the device."""
        raise NotImplementedError(f"backend {type(self).__name__} cannot copy KV blocks in")

    def score(self, batch: ForwardBatch) -> torch.Tensor:
        """Logits at every token, [num_tokens, vocab_size] float32, for a batch of whole prompts with
        ``write_kv=False`` (the cache is neither read nor written): what prompt log-probabilities (``echo`` with
        ``logprobs``) are computed from. Optional."""
        from rtxcore.errors import InvalidRequestError

        raise InvalidRequestError(f"backend {type(self).__name__} does not score prompts", param="logprobs")

    def embed(self, batch: ForwardBatch) -> torch.Tensor:
        """Final hidden states of every token, [num_tokens, hidden_size] float32, for a batch of whole prompts with
        ``write_kv=False`` (the cache is neither read nor written). Optional."""
        from rtxcore.errors import InvalidRequestError

        raise InvalidRequestError(f"backend {type(self).__name__} does not compute embeddings", param="input")
