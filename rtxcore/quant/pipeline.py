"""``rtx quantize``: calibrate on text, quantize each linear layer within its error budget, write the checkpoint,
and measure the result by loading it back and scoring held-out text."""

from __future__ import annotations

import functools
import math
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from rtxcore.contracts.backend import BackendOptions, ExecutionBackend
from rtxcore.contracts.quantizer import LayerStats, QuantizedTensor, Quantizer
from rtxcore.errors import ConfigError, ModelLoadError
from rtxcore.models.resolve import resolve_model
from rtxcore.models.source import ModelSource
from rtxcore.quant import calibration, format_costs, planner
from rtxcore.quant.checkpoint import check_output_dir, staged_checkpoint, write_checkpoint, write_report
from rtxcore.quant.evaluation import backend_perplexity, piece_nlls, prefill_logits
from rtxcore.quant.format_costs import FormatCosts
from rtxcore.quant.layer_errors import Attempt, GroupChoice, choose
from rtxcore.quant.planned_source import PlannedSource
from rtxcore.quant.report import build_report, fallback_reason, short_name
from rtxcore.registry import PluginRegistry
from rtxcore.transfer import release_device_memory

# The backend that runs calibration and evaluation: it exposes the torch modules calibration hooks into.
CALIBRATION_BACKEND = "torch"
_BLOCK = 16
# Planning text comes in pieces this long: more pieces for the same tokens, so the plan sees more topics and their
# spread (which bounds the increase on unseen text) is measured from more of them.
PLANNING_PIECE_LEN = 256
_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


@dataclass(frozen=True, slots=True)
class QuantizeOptions:
    method: str
    out: Path
    # Largest relative output error of a layer on calibration text; None: each method's own budget.
    max_layer_error: float | None = None
    calibration_tokens: int = 8192
    # Evaluation text scored before and after (0: skip).
    eval_tokens: int = 2048
    chunk_len: int = 512
    device: str = "cpu"
    # Precision of the tensors left unquantized (embeddings, norms, LM head, layers that fell back to float).
    dtype: str = "bfloat16"
    # The planner's budget: the largest perplexity increase, held by its bound on unseen text (plan_confidence;
    # rtxcore.quant.planner); None: no plan, each layer in the method unless its own error budget says otherwise.
    target_ppl_delta: float | None = None
    # Calibration text from this file instead of the built-in one (planning text is taken from all of it after what
    # calibration took).
    calibration_file: Path | None = None
    # Planning text scored for each step of the plan, in pieces of PLANNING_PIECE_LEN spread over the calibration text.
    planning_tokens: int = 2048
    # How sure the plan is to hold its budget on unseen text as long as the planning text (rtxcore.quant.planner.score;
    # 0.5: the planning text's own increase).
    plan_confidence: float = 0.95
    # The plan's formats besides float; empty: the method and its fallbacks.
    plan_formats: tuple[str, ...] = ()
    # The plan's costs: None: weight bytes; "measure": kernels timed on ``device``; else a table file
    # (rtxcore.quant.format_costs).
    format_costs: str | None = None


def _load_backend(registry: PluginRegistry, source: ModelSource, device: str, max_len: int,
                  quantizers: dict[str, Quantizer] | None = None) -> ExecutionBackend:
    record = registry.get("backend", CALIBRATION_BACKEND)
    backend = record.cls(BackendOptions(device, "float32", max_batch_size=1, max_model_len=max_len,
                                        enforce_eager=True, quantizers=quantizers or {}))
    backend.load(source)
    backend.allocate_kv_cache(2 + -(-max_len // _BLOCK), _BLOCK)
    return backend


def _tokenizer(source: ModelSource):
    tokenizer = source.tokenizer()
    if tokenizer is None:
        raise ModelLoadError(f"{source.name} has no tokenizer: calibration needs text")
    return tokenizer


def evaluation_tokens(source: ModelSource, num_tokens: int) -> list[int]:
    """The first ``num_tokens`` tokens of the evaluation text, after BOS (the quality gate's text too)."""
    bos = [source.config.bos_token_id] if source.config.bos_token_id is not None else []
    text = calibration.evaluation_text(8 * num_tokens)
    return (bos + _tokenizer(source).encode(text, add_special_tokens=False))[:num_tokens]


def quantize_model(model: str | None, options: QuantizeOptions, registry: PluginRegistry,
                   log: Callable[[str], None] = lambda line: None,
                   progress: Callable[[int, int], None] | None = None,
                   calibrations: dict[tuple, Calibration] | None = None) -> dict[str, Any]:
    """Quantize ``model`` into ``options.out``; returns the report (also saved beside the weights).

    :param log: receives a line as each phase starts and for each layer that falls back.
    :param progress: ``progress(done, total)``, counted in linear layers: ``(0, total)`` before the first is
        quantized, then once per group of layers that run fused (q|k|v, gate|up), the last time with ``done == total``.
    :param calibrations: calibrations made by earlier calls, reused where this one's would be the same (the float
        model's statistics and its perplexities, which no quantizer changes), and this one's added: ``rtx gates``
        plans six methods of one model in a row.
    :raises ConfigError, ModelLoadError, PluginError: bad method, model or output directory; nothing is left at
        ``options.out`` then.
    """
    check_output_dir(options.out)
    if options.target_ppl_delta is not None and not options.target_ppl_delta > 0:
        raise ConfigError(f"--target-ppl-delta must be positive, got {options.target_ppl_delta}")
    if options.target_ppl_delta is not None:
        if not 0.5 <= options.plan_confidence < 1:
            raise ConfigError(f"--plan-confidence must be at least 0.5 and below 1, got {options.plan_confidence}")
        if options.planning_tokens < 2 * PLANNING_PIECE_LEN:
            raise ConfigError(f"--planning-tokens must be at least {2 * PLANNING_PIECE_LEN} (two pieces of "
                              f"{PLANNING_PIECE_LEN}), got {options.planning_tokens}")
        if options.chunk_len < PLANNING_PIECE_LEN:  # the backends are sized for chunk_len tokens
            raise ConfigError(f"a plan needs pieces of at least {PLANNING_PIECE_LEN} tokens, got chunk_len "
                              f"{options.chunk_len}")
    if options.max_layer_error is not None and not options.max_layer_error > 0:
        raise ConfigError(f"--max-layer-error must be positive, got {options.max_layer_error}")
    if options.eval_tokens == 1 or options.eval_tokens < 0:
        raise ConfigError(f"--eval-tokens must be 0 (skip) or at least 2, got {options.eval_tokens}")
    if options.dtype not in _DTYPES:
        raise ConfigError(f"--dtype must be one of {', '.join(_DTYPES)}, got {options.dtype!r}")
    quantizers: dict[str, Quantizer] = {}

    def quantizer_for(name: str) -> Quantizer:
        if name not in quantizers:
            quantizers[name] = registry.create("quantizer", name)
        return quantizers[name]

    if (options.plan_formats or options.format_costs) and options.target_ppl_delta is None:
        raise ConfigError("--plan-formats and --format-costs apply to a plan: add --plan")
    chain = list(dict.fromkeys([options.method, *options.plan_formats])) if options.plan_formats else \
        fallback_chain(options.method, quantizer_for)
    costs = FormatCosts.from_file(Path(options.format_costs)) \
        if options.format_costs not in (None, "measure") else None
    source = resolve_model(model)
    if source.quantization_methods():
        raise ConfigError(f"{source.name} is already quantized ({', '.join(source.quantization_methods())})")
    started = time.perf_counter()
    hessian = any(quantizer_for(m).calibrated and quantizer_for(m).uses_hessian for m in chain)
    key = (model, options.calibration_tokens, options.chunk_len, options.eval_tokens, options.device,
           options.planning_tokens if options.target_ppl_delta is not None else 0, options.calibration_file, hessian)
    calib = calibrations.get(key) if calibrations is not None else None
    if calib is None:
        calib = _calibrate(registry, source, options, hessian, log)
        if calibrations is not None:
            calibrations[key] = calib
    stats, groups, ppl_original, eval_ids, num_chunks = (calib.stats, calib.groups, calib.ppl_eval, calib.eval_ids,
                                                          calib.num_chunks)

    weights: dict[str, torch.Tensor] = {}
    for name, weight in source.weights():
        if isinstance(weight, QuantizedTensor):  # not for a source without quantization methods (checked above)
            raise ConfigError(f"{source.name} is already quantized ({name})")
        weights[name] = weight
    if options.target_ppl_delta is not None:
        if options.format_costs == "measure":
            log(f"timing each format's kernels on {options.device} at the model's shapes")
            costs = format_costs.measure(format_costs.decode_shapes(source.config), chain, quantizer_for,
                                         options.device)
        plan = _plan(registry, source, options, calib, weights, chain, quantizer_for, log, progress, costs)
        choices = plan_choices(plan, options)
    else:
        plan = None
        choices = _choose_each(groups, weights, stats, options, quantizer_for, log, progress)
    del stats
    dtype = _DTYPES[options.dtype]
    tensors: dict[str, torch.Tensor | QuantizedTensor] = {
        name: w.to(dtype) if w.is_floating_point() else w for name, w in weights.items()}
    for choice in choices:
        tensors.update(choice.qtensors)

    report = build_report(source, options, choices, num_chunks * options.chunk_len, tensors)
    if plan is not None:
        report["plan"] = {**plan.to_json(), "planning_pieces": len(calib.plan_pieces),
                          "planning_piece_tokens": PLANNING_PIECE_LEN}
    with staged_checkpoint(options.out) as directory:
        write_checkpoint(directory, source.config.to_hf(), tensors, report, source.tokenizer(),
                         extra={"method": options.method})
        del weights, tensors
        if eval_ids and ppl_original is not None:
            report["evaluation"] = _evaluate(registry, directory, options, eval_ids, ppl_original, quantizer_for)
        report["seconds"] = round(time.perf_counter() - started, 1)
        write_report(directory, report)
    return report


def _choose_each(groups: list[list[str]], weights: dict[str, torch.Tensor], stats: dict[str, LayerStats],
                 options: QuantizeOptions, quantizer_for: Callable[[str], Quantizer], log: Callable[[str], None],
                 progress: Callable[[int, int], None] | None) -> list[GroupChoice]:
    """Without a plan: each group in the method, unless a member's output error is over its budget."""
    choices: list[GroupChoice] = []
    num_layers, num_done = sum(len(names) for names in groups), 0
    if progress is not None:
        progress(0, num_layers)
    for names in groups:
        try:
            choice = choose(names, weights, stats, options.method, quantizer_for, options.max_layer_error)
        except ValueError as exc:  # a shape the method cannot take
            raise ConfigError(f"cannot quantize {', '.join(map(short_name, names))}: {exc}") from None
        choices.append(choice)
        if choice.method != options.method:
            log(f"{', '.join(map(short_name, names))}: {fallback_reason(choice)}")
        num_done += len(names)
        if progress is not None:
            progress(num_done, num_layers)
    return choices


def _plan(registry: PluginRegistry, source: ModelSource, options: QuantizeOptions, calib: Calibration,
          weights: dict[str, torch.Tensor], chain: list[str], quantizer_for: Callable[[str], Quantizer],
          log: Callable[[str], None], progress: Callable[[int, int], None] | None,
          costs: FormatCosts | None) -> planner.Plan:
    """Every format of every group, then the search (rtxcore.quant.planner) scored on the planning text."""
    assert options.target_ppl_delta is not None and calib.plan_pieces
    num_layers, num_done = sum(len(names) for names in calib.groups), 0
    if progress is not None:
        progress(0, num_layers)
    plans = []
    for names in calib.groups:
        try:
            group = planner.group_formats(names, weights, calib.stats, chain, quantizer_for,
                                          costs.cost if costs is not None else None)
        except ValueError as exc:
            raise ConfigError(f"cannot quantize {', '.join(map(short_name, names))}: {exc}") from None
        if options.max_layer_error is not None:  # a layer budget still rules out the formats that exceed it
            group.chosen = next(i for i, f in enumerate(group.formats)
                                if all(e.relative <= options.max_layer_error for e in f.errors.values()))
        plans.append(group)
        num_done += len(names)
        if progress is not None:
            progress(num_done, num_layers)
    log(f"planning on {len(calib.plan_pieces)} x {PLANNING_PIECE_LEN} tokens of calibration text no statistic was "
        f"taken from")

    def evaluate(groups: list[planner.GroupPlan]) -> planner.Score:
        tensors: dict[str, torch.Tensor | QuantizedTensor] = dict(weights)
        for g in groups:
            tensors.update(g.format.qtensors)
        methods = sorted({g.format.method for g in groups if g.format.method is not None})
        backend = _load_backend(registry, PlannedSource(source, tensors, methods), options.device, options.chunk_len,
                                {m: quantizer_for(m) for m in methods})
        try:
            return planner.score(piece_nlls(backend, calib.plan_pieces, _BLOCK), calib.plan_nlls,
                                 options.plan_confidence)
        finally:
            del backend
            release_device_memory()

    basis = f"kernel time on {costs.device}" if costs is not None else "weight bytes"
    ppl_float = math.exp(statistics.fmean(calib.plan_nlls))
    return planner.search(plans, evaluate, ppl_float, options.target_ppl_delta, log, basis, options.plan_confidence)


def plan_choices(plan: planner.Plan, options: QuantizeOptions) -> list[GroupChoice]:
    choices = []
    for g in plan.groups:
        chosen = g.format
        attempts = [Attempt(f.method, options.max_layer_error or math.inf, f.errors)
                    for f in g.formats[:g.chosen + 1] if f.method is not None]
        reason = None
        if chosen.method != options.method:
            reason = (f"the plan chose {chosen.method or 'unquantized (checkpoint precision)'} for it (the model "
                      f"within +{plan.budget} perplexity at the least cost)")
        choices.append(GroupChoice(g.names, chosen.method, chosen.qtensors, attempts, reason))
    return choices


def fallback_chain(method: str, quantizer_for: Callable[[str], Quantizer]) -> list[str]:
    chain = [method]
    while (nxt := quantizer_for(chain[-1]).fallback) is not None and nxt not in chain:
        chain.append(nxt)
    return chain


@dataclass(slots=True)
class Calibration:
    stats: dict[str, LayerStats]
    # Names of the layers that run fused, by group.
    groups: list[list[str]]
    eval_ids: list[int]
    # The float model's perplexity on eval_ids (None without them).
    ppl_eval: float | None
    num_chunks: int
    # Planning text (pieces of calibration text no statistic was taken from) and the float model's mean negative
    # log-likelihood on each.
    plan_pieces: list[list[int]]
    plan_nlls: list[float]


def _calibrate(registry: PluginRegistry, source: ModelSource, options: QuantizeOptions, hessian: bool,
               log: Callable[[str], None]) -> Calibration:
    """Statistics at every decoder linear layer's input on calibration text, the layers that run fused, and the
    float model's perplexity on evaluation (and planning) text. The float model is released before returning."""
    text = _calibration_text(options)
    planning = options.planning_tokens if options.target_ppl_delta is not None else 0
    num_chunks = max(1, options.calibration_tokens // options.chunk_len)
    tokenizer, bos = _tokenizer(source), source.config.bos_token_id
    chunks = calibration.calibration_chunks(tokenizer, bos, num_chunks * options.chunk_len, options.chunk_len,
                                            text=text)
    taken = len(chunks) * (options.chunk_len - (bos is not None))  # the text's tokens calibration took
    plan_pieces = calibration.planning_chunks(tokenizer, bos, planning, PLANNING_PIECE_LEN, taken,
                                              text=text) if planning else []
    if not chunks:
        raise ConfigError(f"--calibration-tokens {options.calibration_tokens} gives no piece of {options.chunk_len}")
    if planning and len(plan_pieces) < 2:
        raise ConfigError("the calibration text is too short to keep planning text apart from calibration: give "
                          "more text or fewer --calibration-tokens")
    if planning and len(plan_pieces) * PLANNING_PIECE_LEN < planning:
        log(f"the calibration text has room for {len(plan_pieces)} planning pieces of {PLANNING_PIECE_LEN} tokens "
            f"past calibration's, not {-(-planning // PLANNING_PIECE_LEN)}: the bound on unseen text is looser")
    backend = _load_backend(registry, source, options.device, options.chunk_len)
    inputs = getattr(getattr(backend, "model", None), "input_modules", None)
    if inputs is None:
        raise ConfigError(f"backend {CALIBRATION_BACKEND!r} does not expose its layers for calibration")
    modules = inputs()
    fused: dict[int, list[str]] = {}
    for name, module in modules.items():
        fused.setdefault(id(module), []).append(name)
    log(f"calibrating on {len(chunks)} x {options.chunk_len} tokens of calibration text")
    # Only the layers' inputs matter: logits after the last token alone spare the LM head's work.
    run = functools.partial(prefill_logits, backend, block_size=_BLOCK, all_positions=False)
    stats = calibration.collect_stats(modules, run, chunks, hessian=hessian)
    eval_ids = evaluation_tokens(source, options.eval_tokens) if options.eval_tokens else []
    ppl = backend_perplexity(backend, eval_ids, options.chunk_len, _BLOCK) if eval_ids else None
    plan_nlls = piece_nlls(backend, plan_pieces, _BLOCK)
    del modules, inputs, run, backend  # release the float model (run holds it too)
    release_device_memory()
    return Calibration(stats, list(fused.values()), eval_ids, ppl, len(chunks), plan_pieces, plan_nlls)


def _calibration_text(options: QuantizeOptions) -> str | None:
    if options.calibration_file is None:
        return None
    try:
        text = options.calibration_file.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"--calibration-file {str(options.calibration_file)!r} cannot be read as UTF-8 text: "
                          f"{getattr(exc, 'strerror', None) or exc}") from None
    if not text.strip():
        raise ConfigError(f"--calibration-file {str(options.calibration_file)!r} is empty")
    return text


def _evaluate(registry: PluginRegistry, directory: Path, options: QuantizeOptions, eval_ids: list[int],
              ppl_original: float, quantizer_for: Callable[[str], Quantizer]) -> dict[str, Any]:
    """Score the written checkpoint, loaded back the way ``rtx serve`` loads it."""
    quantized = resolve_model(str(directory))
    backend = _load_backend(registry, quantized, options.device, options.chunk_len,
                            {m: quantizer_for(m) for m in quantized.quantization_methods()})
    ppl = backend_perplexity(backend, eval_ids, options.chunk_len, _BLOCK)
    del backend
    release_device_memory()
    return {"text": "pydoc_data topics, first half (disjoint from calibration)", "tokens": len(eval_ids),
            "ppl_original": round(ppl_original, 4), "ppl_quantized": round(ppl, 4),
            "ppl_increase": round(ppl - ppl_original, 4)}
