"""``rtx quantize``: post-training quantization of a model into a checkpoint ``rtx serve --model DIR`` loads."""

from __future__ import annotations

import argparse
import signal
import threading
from pathlib import Path

from rtxcore.cli.common import MODEL_ARG, finite_float, non_empty

# The seed's quality gate: int8/int4 within 0.5 perplexity.
DEFAULT_PPL_DELTA = 0.5


def add_parser(sub) -> None:
    p = sub.add_parser(
        "quantize", help="quantize a model's linear weights into a new checkpoint",
        description="Calibrate on text, quantize every decoder linear layer with METHOD (falling back to higher "
                    "precision for layers whose output error exceeds the budget), write safetensors plus a "
                    "quantization config to --out, then score held-out text with the result.")
    # MODEL or --model, as every command that loads a model takes it (merged by the parser: common.MODEL_ARG).
    p.add_argument(MODEL_ARG, nargs="?", type=non_empty, default=None, metavar="MODEL",
                   help="the model, as --model takes it")
    p.add_argument("--model", type=non_empty, default="smollm2-135m",
                   help="smollm2-135m (the default model), a .gguf file or a Hugging Face directory")
    p.add_argument("--method", required=True,
                   help="quantizer plugin: int8, int8-sq, int4, int4-gptq, fp8 or an installed one")
    p.add_argument("--out", required=True, type=Path, help="new directory to write (must not exist or be empty)")
    p.add_argument("--max-layer-error", type=finite_float, default=None, metavar="X",
                   help="largest relative output error of a layer on calibration text before it falls back to "
                        "higher precision (default: the method's own budget)")
    p.add_argument("--plan", action="store_true",
                   help="choose each layer group's format (the method, its fallbacks or float) to keep the model "
                        "within --target-ppl-delta perplexity of the float model, cheapest first")
    p.add_argument("--target-ppl-delta", type=finite_float, default=None, metavar="X",
                   help="the plan's budget: largest perplexity increase, held on unseen text at --plan-confidence "
                        "(implies --plan; default with --plan: 0.5, the seed's quality gate)")
    p.add_argument("--plan-confidence", type=finite_float, default=0.95, metavar="P",
                   help="how sure the plan must be to hold its budget on unseen text as long as the planning text, "
                        "from how much the planning pieces' increases differ (default 0.95; 0.5: the planning text's "
                        "own increase)")
    p.add_argument("--planning-tokens", type=int, default=2048, metavar="N",
                   help="planning text scored at each step of the plan, in pieces of 256 spread over the calibration "
                        "text after what calibration took (default 2048)")
    p.add_argument("--plan-formats", default=None, metavar="LIST",
                   help="comma-separated quantizers the plan may choose from besides float (default: --method and "
                        "its fallbacks), e.g. int4,fp8,int8")
    p.add_argument("--format-costs", default=None, metavar="FILE|measure",
                   help="the plan's cost of each format: a table of kernel times at this model's shapes "
                        "(benchmarks/format_costs.py), or 'measure' to time them on --device first (default: "
                        "weight bytes)")
    p.add_argument("--calibration-tokens", type=int, default=8192)
    p.add_argument("--calibration-file", type=Path, default=None, metavar="FILE",
                   help="UTF-8 text to calibrate (and plan) on instead of the built-in text (pydoc topics)")
    p.add_argument("--eval-tokens", type=int, default=2048, help="held-out tokens scored before and after (0: skip)")
    p.add_argument("--device", default="cpu", help="where calibration runs: cpu or cuda")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"],
                   help="precision of the tensors left unquantized: embeddings, norms, LM head, layers kept in float")
    p.add_argument("--json", action="store_true", help="print the report as JSON instead of a table")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    import json

    from rtxcore.cli.progress import Progress
    from rtxcore.errors import ConfigError
    from rtxcore.quant.pipeline import QuantizeOptions, quantize_model
    from rtxcore.quant.report import render_table
    from rtxcore.registry import load_plugins

    registry = load_plugins()
    if args.method not in registry.names("quantizer"):
        raise ConfigError(f"unknown quantization method {args.method!r}; installed: "
                          f"{', '.join(sorted(registry.names('quantizer')))}")
    if args.calibration_tokens < 1:
        raise ConfigError("--calibration-tokens must be positive")
    if args.device not in ("cpu", "cuda") and not args.device.startswith("cuda:"):
        raise ConfigError(f"--device must be cpu, cuda or cuda:N, got {args.device!r}")
    plan_formats = tuple(f.strip() for f in args.plan_formats.split(",")) if args.plan_formats is not None else ()
    unknown = [f for f in plan_formats if f not in registry.names("quantizer")]
    if unknown or (args.plan_formats is not None and not all(plan_formats)):
        raise ConfigError(f"--plan-formats: unknown quantization method {(unknown or [''])[0]!r}; installed: "
                          f"{', '.join(sorted(registry.names('quantizer')))}")
    target = args.target_ppl_delta if args.target_ppl_delta is not None else (DEFAULT_PPL_DELTA if args.plan else None)
    options = QuantizeOptions(args.method, args.out, args.max_layer_error, args.calibration_tokens, args.eval_tokens,
                              device=args.device, dtype=args.dtype, target_ppl_delta=target,
                              calibration_file=args.calibration_file, planning_tokens=args.planning_tokens,
                              plan_confidence=args.plan_confidence, plan_formats=plan_formats,
                              format_costs=args.format_costs)
    # SIGTERM (timeout, kill, a pod stopped) would end the process without unwinding: the staged checkpoint beside
    # --out would stay. As an exception it is removed on the way out, as on Ctrl-C.
    on_main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, _raise_interrupt) if on_main_thread else None

    progress = Progress("layers", unit="layer")

    def log(line: str) -> None:
        progress.write(f"rtx quantize: {line}")  # above the bar on a terminal, not through it

    try:
        report = quantize_model(args.model, options, registry, log=log, progress=progress)
    finally:
        if on_main_thread:
            signal.signal(signal.SIGTERM, previous)
    if args.json:
        print(json.dumps(report, indent=1))
    else:
        print(render_table(report))
        plan = report.get("plan")
        if plan:
            formats = ", ".join(f"{k} {v}" for k, v in sorted(plan["layers_by_format"].items()))
            print(f"plan: {formats} layers; planning perplexity {plan['planning_ppl_float']:.3f} -> "
                  f"{plan['planning_ppl']:.3f}, on unseen text at most {plan['ppl_increase_bound']:+.3f} at "
                  f"{plan['confidence']:.0%} (budget +{plan['ppl_delta_budget']}); predicted decode speed-up "
                  f"{plan['predicted_decode_speedup_vs_bf16']:.2f}x of bf16 over these layers "
                  f"(costs: {plan['cost_basis']})")
        evaluation = report.get("evaluation")
        if evaluation:
            print(f"perplexity on {evaluation['tokens']} held-out tokens: {evaluation['ppl_original']:.3f} -> "
                  f"{evaluation['ppl_quantized']:.3f} ({evaluation['ppl_increase']:+.3f})")
        b = report["bytes"]
        print(f"weights: {b['source_files'] / 2**20:.1f} MiB of source files -> {b['quantized'] / 2**20:.1f} MiB; "
              f"written to {args.out}")
    return 0


def _raise_interrupt(signum, frame) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # once: a second SIGTERM must not cut the clean-up short
    raise KeyboardInterrupt
