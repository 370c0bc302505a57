"""The Hugging Face transformers baseline: eager ``generate`` on the same weights, whole batch at once, padded."""

from __future__ import annotations

import time

import torch

from rtxcore.bench.offline import ThroughputResult
from rtxcore.bench.workloads import BenchRequest
from rtxcore.contracts.quantizer import QuantizedTensor
from rtxcore.errors import RtxError
from rtxcore.hf_transformers import import_transformers
from rtxcore.models.source import ModelSource


def load_hf_model(source: ModelSource, device: str, dtype: torch.dtype):
    """Build ``LlamaForCausalLM`` from the source's config and load the very same tensors our backend loads."""
    try:
        transformers = import_transformers()
        LlamaConfig, LlamaForCausalLM = transformers.LlamaConfig, transformers.LlamaForCausalLM
    except ImportError as exc:
        raise RtxError(f"the HF baseline needs transformers: pip install 'rtx-serve[hf]' ({exc})") from None
    config = LlamaConfig(**source.config.to_hf())
    config._attn_implementation = "sdpa"
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    state: dict[str, torch.Tensor] = {}
    for name, t in source.weights(device=device, dtype=dtype):
        if isinstance(t, QuantizedTensor):  # a checkpoint written by `rtx quantize`: transformers cannot run it
            raise RtxError(f"the HF baseline needs float weights, but {source.name} stores {name} in its "
                           f"{t.method} form; run the baseline on the unquantized model")
        state[name] = t.to(device=device, dtype=dtype)
    if config.tie_word_embeddings:
        state.setdefault("lm_head.weight", state["model.embed_tokens.weight"])
    model.load_state_dict(state, assign=True, strict=True)
    model.tie_weights()
    # Every request runs to its requested length, as ignore_eos does in the engine.
    model.generation_config.eos_token_id = None
    # Rotary buffers are not in the state dict; rebuild them on the real device.
    with torch.device(device):
        model.model.rotary_emb = type(model.model.rotary_emb)(config=config)
    # Called through nn.Module's signature, which it keeps: functools.wraps leaves PreTrainedModel.to typed as a
    # plain callable whose first argument is the model (typeshed's _Wrapped is not a method). Its override still runs.
    module: torch.nn.Module = model
    return module.to(device).eval()


@torch.inference_mode()
def run_hf_static(model, requests: list[BenchRequest], pad_token_id: int = 0,
                  batch_size: int | None = None) -> ThroughputResult:
    """Static batching: each batch is left-padded to its longest prompt and runs to its longest output; only the
    tokens each request asked for count as output."""
    device = next(model.parameters()).device
    batch_size = batch_size or len(requests)
    ttfts: list[float] = []
    start = time.perf_counter()
    for i in range(0, len(requests), batch_size):
        chunk = requests[i:i + batch_size]
        width = max(len(r.prompt_token_ids) for r in chunk)
        ids = torch.full((len(chunk), width), pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(chunk), width), dtype=torch.long)
        for row, r in enumerate(chunk):
            ids[row, width - len(r.prompt_token_ids):] = torch.tensor(r.prompt_token_ids)
            mask[row, width - len(r.prompt_token_ids):] = 1
        steps = max(r.output_len for r in chunk)
        first_token = _FirstTokenClock()
        model.generate(input_ids=ids.to(device), attention_mask=mask.to(device), max_new_tokens=steps,
                       do_sample=False, pad_token_id=pad_token_id, streamer=first_token)
        # The whole batch gets its first token from the same step.
        ttfts += [(first_token.time if first_token.time is not None else time.perf_counter()) - start] * len(chunk)
    if device.type == "cuda":
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    return ThroughputResult("hf eager (static)", len(requests), sum(r.output_len for r in requests),
                            sum(len(r.prompt_token_ids) for r in requests), elapsed, ttfts)


class _FirstTokenClock:
    """A ``generate`` streamer that notes when the first generated tokens reach the host.

    ``generate`` hands a streamer the prompt first, then each step's tokens (copied to the host, so the step has run).
    Duck-typed rather than derived from transformers' ``BaseStreamer``: this module must import without transformers.
    """

    def __init__(self) -> None:
        self._calls = 0
        self.time: float | None = None

    def put(self, value) -> None:
        self._calls += 1
        if self._calls == 2:
            self.time = time.perf_counter()

    def end(self) -> None:
        pass
