"""The quality gate: perplexity on real English text with the real default model, against Hugging Face transformers
reading the same GGUF file.

A backend's perplexity must stay within a relative change of the reference's; a quantizer is applied to every linear
weight of the reference model (quantize, then dequantize) and may raise its perplexity by a bounded fraction.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from rtx_conformance.checks.paged_driver import PagedDriver
from rtx_conformance.gates.config import QualityGate
from rtxcore.contracts.backend import BackendOptions, ExecutionBackend
from rtxcore.contracts.quantizer import Quantizer
from rtxcore.models.source import ModelSource

_LINEAR_SUFFIXES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True, slots=True)
class QualityResult:
    perplexity: float
    reference_perplexity: float
    # (ppl - reference) / reference.
    relative_change: float
    budget: float
    num_tokens: int
    # "change": |relative_change| must stay within budget; "increase": relative_change must.
    bound: str

    @property
    def passed(self) -> bool:
        change = abs(self.relative_change) if self.bound == "change" else self.relative_change
        return change <= self.budget


def evaluation_tokens(source: ModelSource, num_tokens: int) -> list[int]:
    """The first ``num_tokens`` tokens of CPython's bundled pydoc topics, in key order, after BOS."""
    from pydoc_data.topics import topics

    text = "\n\n".join(topics[key] for key in sorted(topics))
    # English runs about 4 characters a token: 8 per token is plenty, and tokenizing all 465k characters is slow.
    text = text[:8 * num_tokens]
    tokenizer = source.tokenizer()
    bos = [source.config.bos_token_id] if source.config.bos_token_id is not None else []
    return (bos + tokenizer.encode(text))[:num_tokens]


def perplexity(logits: torch.Tensor, token_ids: list[int]) -> float:
    """exp of the mean negative log-likelihood of tokens 1.. given ``logits`` [len - 1, vocab] after each."""
    targets = torch.tensor(token_ids[1:])
    nll = torch.nn.functional.cross_entropy(logits.double(), targets, reduction="mean")
    return math.exp(nll.item())


def load_reference(source: ModelSource):
    """transformers' own GGUF reader and Llama implementation, in float32."""
    from pathlib import Path

    import transformers

    path = Path(source.path)
    transformers.utils.logging.disable_progress_bar()
    model = transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                              dtype=torch.float32)
    return model.eval()


@torch.inference_mode()
def reference_perplexity(model, token_ids: list[int]) -> float:
    logits = model(input_ids=torch.tensor([token_ids])).logits[0, :-1]
    return perplexity(logits, token_ids)


@torch.inference_mode()
def run_backend_quality(gate: QualityGate, backend_cls: type[ExecutionBackend], source: ModelSource,
                        token_ids: list[int], reference_ppl: float) -> QualityResult:
    backend = backend_cls(BackendOptions(device="auto", dtype="float32", max_batch_size=1,
                                         max_model_len=len(token_ids)))
    backend.load(source)
    driver = PagedDriver(backend, num_blocks=-(-len(token_ids) // 16) + 2, block_size=16)
    ppl = perplexity(driver.score(token_ids), token_ids)
    return QualityResult(ppl, reference_ppl, (ppl - reference_ppl) / reference_ppl,
                         gate.backend_max_relative_change, len(token_ids), "change")


@torch.inference_mode()
def run_quantizer_quality(gate: QualityGate, quantizer: Quantizer, model, token_ids: list[int],
                          reference_ppl: float) -> QualityResult:
    """Swap every linear weight for its quantized approximation, measure, and put the originals back."""
    originals: dict[str, torch.Tensor] = {}
    try:
        for name, module in model.named_modules():
            if name.endswith(_LINEAR_SUFFIXES):
                originals[name] = module.weight.data
                module.weight.data = quantizer.dequantize(quantizer.quantize(module.weight.data)).to(torch.float32)
        ppl = reference_perplexity(model, token_ids)
    finally:
        modules = dict(model.named_modules())
        for name, weight in originals.items():
            modules[name].weight.data = weight
    return QualityResult(ppl, reference_ppl, (ppl - reference_ppl) / reference_ppl,
                         gate.quantizer_max_relative_increase, len(token_ids), "increase")
