"""The torch execution backend ("Triton eager"): a Llama-family model in torch over a preallocated paged KV cache."""

from __future__ import annotations

import torch

from rtxcore.contracts.backend import BackendCapabilities, BackendOptions, ExecutionBackend, ForwardBatch
from rtxcore.errors import ConfigError, ModelLoadError
from rtxcore.models.config import ModelConfig
from rtxcore.models.source import ModelSource
from rtx_kernels.cpu_ops import paged_decode_kernel
from rtx_plugins.backends.torch_backend.cpu_tuning import tune_allocator
from rtx_plugins.backends.torch_backend.attention import AttentionMetadata, paged_attention
from rtx_plugins.backends.torch_backend.model import LlamaForCausalLM

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# KV cache size on the CPU when none is configured: enough for the CPU workloads, small next to 24 GiB.
_CPU_KV_BYTES = 2 << 30
_CUDA_KV_FRACTION = 0.85


class TorchBackend(ExecutionBackend):
    @classmethod
    def capabilities(cls) -> BackendCapabilities:
        devices = ("cpu", "cuda") if torch.cuda.is_available() else ("cpu",)
        return BackendCapabilities(devices=devices, dtypes=tuple(_DTYPES), paged_kv=True)

    def __init__(self, options: BackendOptions):
        super().__init__(options)
        device = options.device
        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        if device.startswith("cuda") and not torch.cuda.is_available():
            raise ConfigError("device 'cuda' asked for, but torch sees no CUDA device")
        self._device = torch.device(device)
        dtype = options.dtype
        if dtype == "auto":
            dtype = "bfloat16" if self._device.type == "cuda" else "float32"
        if dtype not in _DTYPES:
            raise ConfigError(f"dtype {dtype!r} is not supported by the torch backend; use one of {', '.join(_DTYPES)}")
        self.dtype = _DTYPES[dtype]
        self._decode_kernel = None
        if self._device.type == "cpu":
            tune_allocator()
            if self.dtype == torch.float32:
                self._decode_kernel = paged_decode_kernel()
        self.model: LlamaForCausalLM | None = None
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.block_size = 0

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
        with torch.device("meta"):
            model = LlamaForCausalLM(cfg)
        model = model.to(self.dtype).to_empty(device=self._device)
        # Buffers (rotary tables) are not in checkpoints: rebuild them on the real device.
        for module in model.modules():
            if hasattr(module, "cos"):
                fresh = type(module)(cfg.head_dim, cfg.max_position, cfg.rope_theta, cfg.rope_scaling)
                module.cos, module.sin = fresh.cos.to(self._device), fresh.sin.to(self._device)
        expected = {n for n, _ in model.named_parameters()}
        loaded: set[str] = set()
        for name, tensor in source.weights(progress=progress, device=self._device, dtype=self.dtype):
            if not model.load_weight(name, tensor.to(self._device)):
                raise ModelLoadError(f"{source.name}: unexpected weight {name!r} in checkpoint")
            loaded.add(_param_name(model, name))
        missing = expected - loaded
        if missing:
            raise ModelLoadError(f"{source.name}: checkpoint lacks weights: {', '.join(sorted(missing)[:5])}")
        self.model = model.eval()

    def kv_cache_bytes_per_token(self) -> int:
        cfg = self.model_config
        return 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * self.dtype.itemsize

    def available_kv_cache_bytes(self) -> int:
        if self._device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self._device)
            return int(free * _CUDA_KV_FRACTION)
        return _CPU_KV_BYTES

    def allocate_kv_cache(self, num_blocks: int, block_size: int) -> None:
        cfg = self.model_config
        shape = (cfg.num_kv_heads, num_blocks, block_size, cfg.head_dim)
        self.kv_caches = [
            (torch.zeros(shape, dtype=self.dtype, device=self._device),
             torch.zeros(shape, dtype=self.dtype, device=self._device))
            for _ in range(cfg.num_layers)
        ]
        self.block_size = block_size

    @torch.inference_mode()
    def execute(self, batch: ForwardBatch) -> torch.Tensor:
        hidden = self._hidden_states(batch)
        return self.model.compute_logits(hidden[batch.logits_indices.to(self._device)]).float()

    @torch.inference_mode()
    def embed(self, batch: ForwardBatch) -> torch.Tensor:
        return self._hidden_states(batch).float()

    def _hidden_states(self, batch: ForwardBatch) -> torch.Tensor:
        meta = AttentionMetadata.from_batch(batch, self._device, self._decode_kernel)
        return self.model.hidden_states(
            batch.input_ids.to(self._device), batch.positions.to(self._device), self.kv_caches, meta, paged_attention)


def _param_name(model: LlamaForCausalLM, ckpt_name: str) -> str:
    name = ckpt_name.removeprefix("model.")
    if name == "lm_head.weight" and model.config.tie_word_embeddings:
        return "embed_tokens.weight"
    for ckpt, (merged, _) in model.packed_modules.items():
        name = name.replace(f".{ckpt}.", f".{merged}.")
    return name
