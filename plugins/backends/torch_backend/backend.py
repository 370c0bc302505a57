"""The torch execution backend ("Triton eager"): a Llama-family model in torch over a preallocated paged KV cache.

With ``tensor_parallel_size`` or ``pipeline_parallel_size`` above 1 the model and the KV cache are split across
ranks (see the ``parallel`` package): this backend is then rank 0, which forwards every step to the others. KV tiers
(``read_kv_blocks`` / ``write_kv_blocks``), ``execute_layers`` and ``embed`` are not supported with either yet, and
pipeline stages run without CUDA graphs.
"""

from __future__ import annotations

import functools
import importlib.util
import weakref
from collections.abc import Sequence
from typing import Any

import torch

from rtx_kernels.cpu_ops import paged_decode_kernel
from rtx_plugins.backends.torch_backend.allocation import materialize, zeroed_host_tensor
from rtx_plugins.backends.torch_backend.attention import AttentionMetadata, paged_attention
from rtx_plugins.backends.torch_backend.cpu_tuning import tune_allocator
from rtx_plugins.backends.torch_backend.layers import ParallelContext, RotaryEmbedding
from rtx_plugins.backends.torch_backend.model import LlamaForCausalLM
from rtx_plugins.backends.torch_backend.ops import torch_ops, triton_ops
from rtx_plugins.backends.torch_backend.parallel import launch, pipeline
from rtx_plugins.backends.torch_backend.quantized import to_device
from rtxcore import envs
from rtxcore.contracts.backend import (
    ANY_QUANTIZATION,
    BackendCapabilities,
    BackendOptions,
    ExecutionBackend,
    ForwardBatch,
    default_kv_cache_bytes,
)
from rtxcore.contracts.quantizer import QuantizedTensor, Quantizer
from rtxcore.errors import ConfigError, ModelLoadError
from rtxcore.kv.block_io import read_blocks, write_blocks
from rtxcore.models.config import ModelConfig
from rtxcore.models.source import ModelSource
from rtxcore.transfer import to_device_async

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# KV cache dtypes besides "auto" (the compute dtype). fp8 is e4m3 stored unscaled, the format the Triton kernels
# write and read (rtx_kernels.rotary.FP8_KV_DTYPE) and the plain-torch attention too.
_KV_CACHE_DTYPES = {"fp8": torch.float8_e4m3fn}
# Share of the GPU's free memory (after the weights) the KV cache takes when no size is configured.
_CUDA_KV_FRACTION = 0.85


class TorchBackend(ExecutionBackend):
    @classmethod
    def capabilities(cls) -> BackendCapabilities:
        devices = ("cpu", "cuda") if torch.cuda.is_available() else ("cpu",)
        # Any quantizer: a quantized layer runs through its quantizer's own linear().
        return BackendCapabilities(devices=devices, dtypes=tuple(_DTYPES), paged_kv=True, kv_offload=True,
                                   quantization_formats=(ANY_QUANTIZATION,), layer_subset=True,
                                   tensor_parallel=True, pipeline_parallel=True,
                                   kv_cache_dtypes=("auto", *_KV_CACHE_DTYPES))

    def __init__(self, options: BackendOptions, rank: int | None = None):
        """:param rank: set by a parallel worker (tensor or pipeline) for its own rank; None in the engine's
        process."""
        super().__init__(options)
        device = options.device
        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        if device.startswith("cuda") and not torch.cuda.is_available():
            raise ConfigError("device 'cuda' asked for, but torch sees no CUDA device")
        try:
            self._device = torch.device(device)
        except RuntimeError:  # not a device name torch knows
            self._device = None
        if self._device is None or self._device.type not in ("cpu", "cuda"):
            raise ConfigError(f"device {device!r} is not one the torch backend runs on; use cpu, cuda, cuda:N or "
                              "auto")
        dtype = options.dtype
        if dtype == "auto":
            dtype = "bfloat16" if self._device.type == "cuda" else "float32"
        if dtype not in _DTYPES:
            raise ConfigError(f"dtype {dtype!r} is not supported by the torch backend; use one of {', '.join(_DTYPES)}")
        self.dtype = _DTYPES[dtype]
        if options.kv_cache_dtype != "auto" and options.kv_cache_dtype not in _KV_CACHE_DTYPES:
            raise ConfigError(f"KV cache dtype {options.kv_cache_dtype!r} is not supported by the torch backend; use "
                              f"auto or {', '.join(_KV_CACHE_DTYPES)}")
        self.kv_cache_dtype = _KV_CACHE_DTYPES.get(options.kv_cache_dtype, self.dtype)
        self._decode_kernel = None
        # On CUDA: Triton kernels, and CUDA graphs for decode steps unless enforce_eager. Without Triton the
        # plain torch path runs there too.
        kernels = envs.RTX_TORCH_KERNELS.get()
        if kernels == "triton" and importlib.util.find_spec("triton") is None:
            raise ConfigError("RTX_TORCH_KERNELS=triton, but triton is not installed")
        # "triton" on the CPU runs the kernels in Triton's interpreter (TRITON_INTERPRET=1): slow, for tests.
        self._triton = kernels == "triton" or (
            kernels == "auto" and self._device.type == "cuda" and importlib.util.find_spec("triton") is not None)
        self._graphs = None
        # Decode graphs of layer subsets (self-speculative drafts), by the layers they run.
        self._subset_graphs: dict[tuple[int, ...], Any] = {}
        # Piecewise graphs for steps that carry prefill tokens (everything but attention captured).
        self._mixed = None
        if self._triton:
            # Imported only here: CPU installs need not have Triton.
            from rtx_plugins.backends.torch_backend import cuda_graphs, piecewise_graphs, triton_attention
            self._gpu_attention = triton_attention
            self._graph_module = cuda_graphs
            self._piecewise_module = piecewise_graphs
        if self.kv_cache_dtype.itemsize == 1 and self._triton and self._device.type == "cuda":
            major, minor = torch.cuda.get_device_capability(self._device)
            if (major, minor) < (8, 9):
                raise ConfigError(f"--kv-cache-dtype {options.kv_cache_dtype} needs a GPU of compute capability 8.9 "
                                  f"or later (Ada, Hopper), whose Triton kernels read e4m3; this one is "
                                  f"{major}.{minor}")
        if self._device.type == "cpu":
            tune_allocator()
            # The C++ decode kernel reads a float32 cache only.
            if self.dtype == self.kv_cache_dtype == torch.float32 and not self._triton:
                self._decode_kernel = paged_decode_kernel()
        self.model: LlamaForCausalLM | None = None
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._kv_pool: torch.Tensor | None = None
        self.block_size = 0
        self._rank = rank
        self._ctx = ParallelContext()
        # Rank 0's link to the other ranks (a parallel size above 1, in the engine's process), else None.
        self._ranks: launch.ParallelRanks | None = None
        self._shutdown_ranks: weakref.finalize | None = None
        # This rank's part of the pipeline (pipeline_parallel_size > 1), else None.
        self._pipeline: pipeline.PipelineStage | None = None
        # This rank's share of the heads (all of them without tensor parallelism).
        self._num_heads = self._num_kv_heads = 0

    def close(self) -> None:
        """Stop the other tensor-parallel ranks now rather than when this backend is collected (nothing to do
        without them). The backend cannot execute afterwards."""
        if self._shutdown_ranks is not None:
            self._shutdown_ranks()

    @property
    def device(self) -> torch.device:
        return self._device

    @property
    def model_config(self) -> ModelConfig:
        if self.model is None:
            raise RuntimeError("no model loaded")
        return self.model.config

    def load(self, source: ModelSource, progress=None) -> None:
        cfg = source.config
        tp_size, pp_size = self.options.tensor_parallel_size, self.options.pipeline_parallel_size
        if tp_size * pp_size > 1:
            # Checked before any process starts, so a bad size is one clear error rather than one per rank.
            launch.check_divisible(cfg, tp_size, pp_size)
            if self._rank is None:
                self._ranks = launch.start(self.options, source, self._device)
                # Workers hear SHUTDOWN when this backend goes away, or at interpreter exit at the latest.
                self._shutdown_ranks = weakref.finalize(self, self._ranks.shutdown)
                self._device = self._ranks.device
            self._ctx = launch.parallel_context(self._rank or 0, tp_size, pp_size)
            if pp_size > 1:
                self._pipeline = pipeline.PipelineStage(self._ctx, cfg.hidden_size, cfg.vocab_size, self.dtype,
                                                        self._device)
        self._num_heads, self._num_kv_heads = cfg.num_heads // tp_size, cfg.num_kv_heads // tp_size
        with torch.device("meta"):
            # RTX_TORCH_GEMV=0 keeps small-batch projections on cuBLAS (to compare the two).
            ops = triton_ops(gemv=envs.RTX_TORCH_GEMV.get()) if self._triton else torch_ops()
            model = LlamaForCausalLM(cfg, self._ctx, ops=ops)
        model = materialize(model, self._device, self.dtype)
        # Buffers (rotary tables) are not in checkpoints: rebuild them, in float32, on the real device.
        for module in model.modules():
            if isinstance(module, RotaryEmbedding):
                module.cos, module.sin = module.tables(self._device)
        loaded: set[str] = set()
        for name, tensor in source.weights(progress=progress, device=self._device, dtype=self.dtype):
            try:
                if isinstance(tensor, QuantizedTensor):
                    slot = model.load_weight(name, to_device(tensor, self._device), self._quantizer_for(tensor.method))
                else:
                    slot = model.load_weight(name, tensor.to(self._device))
            except ValueError as exc:
                raise ModelLoadError(f"{source.name}: weight {name!r} {exc}") from None
            except (TypeError, AttributeError, KeyError) as exc:  # e.g. a quantized layer's "meta" that is no table
                raise ModelLoadError(f"{source.name}: weight {name!r} is malformed ({type(exc).__name__}: {exc})") \
                    from exc
            if slot is None:
                raise ModelLoadError(f"{source.name}: unexpected weight {name!r} in checkpoint")
            loaded.add(slot)
        # Per part of a merged layer: a checkpoint with k_proj and v_proj but no q_proj fills qkv_proj only in part.
        missing = {model.checkpoint_name(slot) for slot in model.weight_slots() - loaded}
        partial = [name for name, m in model.linear_layers().items() if m.waiting_for_shards]
        if missing or partial:
            raise ModelLoadError(f"{source.name}: checkpoint lacks weights: "
                                 f"{', '.join(sorted(missing or partial)[:5])}")
        if self.options.quantizer is not None:
            # Quantized as it loads (--quantization): each layer's float weight is freed as its quantized form lands.
            for name, layer in model.linear_layers().items():
                if layer.quantized is None:
                    try:
                        layer.quantize(self.options.quantizer)
                    except ValueError as exc:  # a shape the method cannot take
                        raise ConfigError(f"--quantization cannot quantize {name}: {exc}") from None
        self.model = model.eval()

    def _quantizer_for(self, method: str) -> Quantizer:
        quantizer = self.options.quantizers.get(method)
        if quantizer is None:
            raise ModelLoadError(f"the checkpoint has {method!r}-quantized weights, but no quantizer plugin of that "
                                 f"name was given to the backend (installed: {', '.join(self.options.quantizers)})")
        return quantizer

    def weight_bytes(self) -> int:
        """Bytes of the weights as held (quantized layers at their stored size; a tied LM head once)."""
        total = sum(p.numel() * p.element_size() for p in self.model.parameters())
        for layer in self.model.linear_layers().values():
            if layer.quantized is not None:
                total += sum(t.numel() * t.element_size() for t in layer.quantized.qtensor.tensors.values())
        return total

    def kv_cache_bytes_per_token(self) -> int:
        # This rank's share: each rank holds the K/V of its own KV heads in its own stage's layers, so memory sizes
        # the cache per rank.
        ctx = self._ctx
        return self.model_config.kv_cache_bytes_per_token(self.kv_cache_dtype.itemsize) // ctx.tp_size // ctx.pp_size

    def available_kv_cache_bytes(self) -> int:
        return default_kv_cache_bytes(self._device, _CUDA_KV_FRACTION)

    def allocate_kv_cache(self, num_blocks: int, block_size: int) -> None:
        cfg = self.model_config
        if self._ranks is not None:
            self._ranks.allocate_kv_cache(num_blocks, block_size)
        # One tensor [layers, K/V, kv_heads, blocks, block_size, head_dim], each layer's K and V a contiguous view:
        # copying blocks to and from the KV tiers is then one gather or scatter for all layers, not one per cache.
        # A pipeline stage holds its own layers' caches only; kv_caches stays indexed by layer (None elsewhere).
        stage = self.model.stage_layers
        shape = (len(stage), 2, self._num_kv_heads, num_blocks, block_size, cfg.head_dim)
        self._kv_pool = zeroed_host_tensor(shape, self.kv_cache_dtype) if self._device.type == "cpu" else \
            torch.zeros(shape, dtype=self.kv_cache_dtype, device=self._device)
        self.kv_caches = [None] * cfg.num_layers  # type: ignore[list-item]
        for i, layer in zip(stage, self._kv_pool):
            self.kv_caches[i] = (layer[0], layer[1])
        self.block_size = block_size
        # With tensor parallelism every rank captures its own graphs, collectives (NCCL) inside, here: all ranks
        # allocate on the same command and capture the same sizes in the same order, so their collectives pair up;
        # each step then takes the same decision (graph or eager) from the same batch. Pipeline stages run eagerly:
        # their sends and receives between micro-batches are not captured.
        if (self._triton and self._device.type == "cuda" and not self.options.enforce_eager
                and self._ctx.pp_size == 1):
            max_len = min(cfg.max_position, self.options.max_model_len or cfg.max_position)
            self._graphs = self._graph_module.DecodeGraphs(
                self._decode_logits, self.options.max_batch_size, max_len, block_size, self._num_kv_heads, self._device)
            self._mixed = self._piecewise_module.PiecewiseGraphs(self.model, self.kv_caches, self._device)
            with torch.inference_mode():
                self._graphs.capture()
                self._mixed.capture()

    # A block's bytes are layer by layer, K then V, each [kv_heads, block_size, head_dim]: the pool's own order.
    def read_kv_blocks(self, block_ids: list[int]) -> torch.Tensor:
        self._refuse_when_split("KV tiers")
        return read_blocks([self._kv_pool], 3, block_ids)

    def write_kv_blocks(self, block_ids: list[int], data: torch.Tensor) -> None:
        self._refuse_when_split("KV tiers")
        write_blocks([self._kv_pool], 3, block_ids, data)

    def execute(self, batch: ForwardBatch) -> torch.Tensor:
        # run_step is where inference mode starts: workers enter there too.
        num_micro = self._pipeline.num_micro_batches(batch) if self._pipeline is not None else 1
        if self._ranks is None:
            logits = self.run_step(batch, num_micro)
        else:
            try:
                self._ranks.execute(batch, num_micro)
                logits = self.run_step(batch, num_micro)
            except RuntimeError as exc:  # a collective or a send failed: name the rank if one of ours is gone
                self._ranks.check_workers(grace_s=2.0)
                raise RuntimeError(f"a parallel rank failed during a step: {exc}") from exc
        assert logits is not None  # rank 0 is in the first stage, which computes the logits
        return logits

    @torch.inference_mode()
    def run_step(self, batch: ForwardBatch, num_micro_batches: int = 1) -> torch.Tensor | None:
        """This rank's share of a step: rank 0 after sending the step to the others, a worker when it arrives.

        :returns: the logits; None on a pipeline stage other than the first.
        """
        if self._pipeline is not None:
            return self._pipeline.execute(batch, num_micro_batches, self._run_stage, self._logits)
        if self._graphs is not None and self._graphs.can_run(batch):
            return self._graphs.run(batch)
        if self._triton:
            meta, attention = self._attention(batch)
            if self._mixed is not None and self._mixed.can_run(batch):
                hidden = self._mixed.hidden_states(batch, meta)
            else:
                hidden = self.model.hidden_states(self._to_device(batch.input_ids),
                                                  self._to_device(batch.positions), self.kv_caches, meta, attention)
        else:
            hidden = self._torch_hidden_states(batch)
        return self.model.compute_logits(hidden[self._to_device(batch.logits_indices)]).float()

    @torch.inference_mode()
    def execute_layers(self, batch: ForwardBatch, layers: Sequence[int]) -> torch.Tensor:
        self._refuse_when_split("running a subset of the layers (self-speculation)")
        if self._graphs is not None:
            # A draft decodes one token per request per round, many rounds a step: its own ladder of graphs (up to
            # the batch size where speculation still pays), captured the first time a subset is asked for.
            key = tuple(layers)
            graphs = self._subset_graphs.get(key)
            if graphs is None:
                graphs = self._graph_module.DecodeGraphs(
                    functools.partial(self._decode_logits, layers=key), min(self.options.max_batch_size, 32),
                    self._graphs.max_model_len, self.block_size, self._num_kv_heads, self._device)
                graphs.capture()
                self._subset_graphs[key] = graphs
            if graphs.can_run(batch):
                return graphs.run(batch)
        meta, attention = self._attention(batch)
        hidden = self.model.hidden_states(self._to_device(batch.input_ids), self._to_device(batch.positions),
                                          self.kv_caches, meta, attention, layers=layers)
        return self.model.compute_logits(hidden[self._to_device(batch.logits_indices)]).float()

    @torch.inference_mode()
    def embed(self, batch: ForwardBatch) -> torch.Tensor:
        self._refuse_when_split("embeddings")
        # Whole prompts with no cache: the torch path's attention over the fresh K/V serves every device.
        return self._torch_hidden_states(batch).float()

    @torch.inference_mode()
    def score(self, batch: ForwardBatch) -> torch.Tensor:
        self._refuse_when_split("prompt log-probabilities")
        return self.model.compute_logits(self._torch_hidden_states(batch)).float()

    def _decode_logits(self, input_ids: torch.Tensor, positions: torch.Tensor, meta,
                       layers: Sequence[int] | None = None) -> torch.Tensor:
        hidden = self.model.hidden_states(input_ids, positions, self.kv_caches, meta,
                                          self._gpu_attention.triton_paged_attention, layers=layers)
        return self.model.compute_logits(hidden).float()

    def _torch_hidden_states(self, batch: ForwardBatch) -> torch.Tensor:
        meta = AttentionMetadata.from_batch(batch, self._device, self._decode_kernel)
        return self.model.hidden_states(self._to_device(batch.input_ids), self._to_device(batch.positions),
                                        self.kv_caches, meta, paged_attention)

    def _run_stage(self, batch: ForwardBatch, inputs: torch.Tensor) -> torch.Tensor:
        meta, attention = self._attention(batch)
        return self.model.stage_forward(inputs, self._to_device(batch.positions), self.kv_caches, meta, attention)

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.model.compute_logits(hidden).float()

    def _attention(self, batch: ForwardBatch) -> tuple[object, Any]:
        """The step's attention metadata and the attention function that reads it."""
        if self._triton:
            gpu, cfg = self._gpu_attention, self.model_config
            return (gpu.TritonAttentionMetadata.from_batch(batch, self._device, self._num_kv_heads, self._num_heads,
                                                           cfg.head_dim), gpu.triton_paged_attention)
        return AttentionMetadata.from_batch(batch, self._device, self._decode_kernel), paged_attention

    def _refuse_when_split(self, what: str) -> None:
        # The other ranks run only what execute() sends them; these would leave them behind.
        ctx = self._ctx
        if ctx.tp_size * ctx.pp_size > 1:
            raise ConfigError(f"{what}: not supported with tensor or pipeline parallelism yet (tensor_parallel_size "
                              f"{ctx.tp_size}, pipeline_parallel_size {ctx.pp_size})")

    def _to_device(self, t: torch.Tensor) -> torch.Tensor:
        return to_device_async(t, self._device)
