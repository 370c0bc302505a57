"""The quality gate: perplexity on real English text with the real default model, against Hugging Face transformers
reading the same GGUF file.

A backend's perplexity must stay within a relative change of the reference's. A quantizer runs every linear layer of
the reference model from its quantized form (after calibration on disjoint text, for a calibrated method) and may
raise its perplexity by a bounded amount: absolute for the methods the gate names, relative for any other.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from rtx_conformance.checks.paged_driver import PagedDriver
from rtx_conformance.gates.config import QualityGate
from rtxcore.contracts.backend import BackendOptions, ExecutionBackend
from rtxcore.contracts.quantizer import LayerStats, Quantizer
from rtxcore.models.source import ModelSource
from rtxcore.quant import calibration
from rtxcore.quant.evaluation import perplexity
from rtxcore.quant.pipeline import evaluation_tokens as quantization_evaluation_tokens

_LINEAR_SUFFIXES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True, slots=True)
class QualityResult:
    perplexity: float
    reference_perplexity: float
    # (ppl - reference) / reference.
    relative_change: float
    budget: float
    num_tokens: int
    # "change": |relative_change| must stay within budget; "increase": relative_change must; "absolute":
    # perplexity - reference must.
    bound: str
    # A calibrated quantizer's uncalibrated baseline (the gate's must_beat): its perplexity, which must be higher.
    baseline_perplexity: float | None = None

    @property
    def change(self) -> float:
        if self.bound == "absolute":
            return self.perplexity - self.reference_perplexity
        return abs(self.relative_change) if self.bound == "change" else self.relative_change

    @property
    def passed(self) -> bool:
        beats = self.baseline_perplexity is None or self.perplexity < self.baseline_perplexity
        return self.change <= self.budget and beats


def evaluation_tokens(source: ModelSource, num_tokens: int) -> list[int]:
    """The first ``num_tokens`` tokens of the evaluation half of CPython's bundled pydoc topics, after BOS: text no
    quantizer calibrates on."""
    return quantization_evaluation_tokens(source, num_tokens)


def load_reference(source: ModelSource):
    """transformers' own GGUF reader and Llama implementation, in float32."""
    from pathlib import Path

    from rtxcore.hf_transformers import import_transformers

    transformers = import_transformers()
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


def calibrate_reference(model, source: ModelSource, num_tokens: int, chunk_len: int) -> dict[str, LayerStats]:
    """Statistics at every linear layer's input of the reference model over calibration text (disjoint from the
    evaluation text), as ``rtx quantize`` collects them."""
    chunks = calibration.calibration_chunks(source.tokenizer(), source.config.bos_token_id, num_tokens, chunk_len)
    modules = {f"{name}.weight": m for name, m in model.named_modules() if name.endswith(_LINEAR_SUFFIXES)}
    return calibration.collect_stats(modules, lambda chunk: model(input_ids=torch.tensor([chunk])), chunks)


@torch.inference_mode()
def quantized_perplexity(quantizer: Quantizer, model, token_ids: list[int],
                         stats: dict[str, LayerStats] | None) -> float:
    """Run every linear layer of the reference model through the quantizer (its ``linear``: the stored weight, and
    activation rounding where the method has it), measure, and put the layers back."""
    patched = []
    try:
        for name, module in model.named_modules():
            if name.endswith(_LINEAR_SUFFIXES):
                weight = module.weight.data
                qt = quantizer.quantize(weight, stats[f"{name}.weight"]) if stats else quantizer.quantize(weight)
                module.forward = functools.partial(_quantized_forward, quantizer, qt, module.bias)
                patched.append(module)
        return reference_perplexity(model, token_ids)
    finally:
        for module in patched:
            del module.forward  # back to the class's forward


def _quantized_forward(quantizer: Quantizer, qt, bias, x: torch.Tensor) -> torch.Tensor:
    # transformers passes [batch, tokens, features]; a quantizer's linear takes rows.
    y = quantizer.linear(x.reshape(-1, x.shape[-1]), qt, bias)
    return y.reshape(*x.shape[:-1], y.shape[-1])


def run_quantizer_quality(gate: QualityGate, quantizer: Quantizer, name: str, model, token_ids: list[int],
                          reference_ppl: float, stats: dict[str, LayerStats] | None,
                          baseline: Quantizer | None = None) -> QualityResult:
    """A method with its own line in the gate is held to an absolute perplexity increase (and, calibrated, to beating
    its uncalibrated baseline); any other quantizer to a relative increase."""
    ppl = quantized_perplexity(quantizer, model, token_ids, stats if quantizer.calibrated else None)
    baseline_ppl = quantized_perplexity(baseline, model, token_ids, None) if baseline is not None else None
    if name in gate.quantizer_max_ppl_increase:
        return QualityResult(ppl, reference_ppl, (ppl - reference_ppl) / reference_ppl,
                             gate.quantizer_max_ppl_increase[name], len(token_ids), "absolute", baseline_ppl)
    return QualityResult(ppl, reference_ppl, (ppl - reference_ppl) / reference_ppl,
                         gate.quantizer_max_relative_increase, len(token_ids), "increase", baseline_ppl)
