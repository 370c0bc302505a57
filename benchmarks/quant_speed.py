"""Quantized decoding speed on the GPU: W3 (one stream) and W1 (256 requests) for bf16 and each quantization method,
on the same random weights, all in one run so every ratio is against the bf16 baseline measured beside it.

The random weights are drawn once and kept in host memory as bf16; each engine loads its copy from there and, for
a method, quantizes each layer as it lands (``--quantization``: plain rounding, which runs at the same speed as a
calibrated checkpoint of the same format).

Usage: python benchmarks/quant_speed.py [--model dummy:llama-8b] [--methods int8,int4,fp8] [--plan DIR ...]
       [--workloads W3,W1] [--repeats N] [--json OUT]

``--plan DIR`` (repeatable) also runs a mixed-precision plan that ``rtx quantize --plan --out DIR`` wrote for another
model of the same architecture (the default model: random shapes have no text to plan on), laid over this one by
relative depth (``rtxcore.quant.plan_layout``); only ``DIR/config.json`` is read.

With ``--repeats N`` each workload runs N times on the same engine and reports the median (every run is kept in the
JSON): one W3 run is 256 tokens, short enough for the GPU's clocks to move it by a few percent.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import time

import torch

from rtxcore.bench.engine import build_engine
from rtxcore.bench.offline import run_engine, warm_up
from rtxcore.bench.workloads import BenchRequest, make_requests
from rtxcore.cli.bench import H200_COPY_BYTES_PER_S, machine_description
from rtxcore.contracts.quantizer import Quantizer
from rtxcore.contracts.scheduler import SchedulerConfig
from rtxcore.errors import ConfigError
from rtxcore.models.resolve import resolve_model
from rtxcore.models.source import ModelSource
from rtxcore.quant.plan_layout import LaidOutSource, read_plan
from rtxcore.registry import load_plugins
from rtxcore.transfer import release_device_memory

# Published by NVIDIA, not measured here: TensorRT-LLM, one H200, Llama-3.1-8B FP8, 128/128 at max load.
TRTLLM_FP8_H200_TOK_S = 27911


class HostCopy(ModelSource):
    """Another source's weights, drawn once and kept in host memory as bf16."""

    def __init__(self, source: ModelSource):
        self.name, self.path, self._config = source.name, source.path, source.config
        self._weights = [(name, t.to(torch.bfloat16)) for name, t in source.weights()]

    @property
    def config(self):
        return self._config

    def tokenizer(self):
        return None

    def num_weights(self) -> int:
        return len(self._weights)

    def names(self) -> list[str]:
        return [name for name, _ in self._weights]

    def weights(self, progress=None, device="cpu", dtype=torch.float32):
        for name, t in self._weights:
            yield name, t.to(device=device, dtype=dtype)


def measure(source: ModelSource, method: str | None, model: str, workloads: list[str], repeats: int,
            label: str | None = None) -> dict:
    started = time.perf_counter()
    engine = build_engine(source=source, model=model, quantization=method, max_model_len=4096,
                          scheduling=SchedulerConfig(max_num_batched_tokens=8192, max_num_seqs=256))
    loaded_s = time.perf_counter() - started
    weight_bytes = engine.core.backend.weight_bytes()
    out = {"method": label or method or "bf16", "weight_bytes": weight_bytes, "load_s": round(loaded_s, 1)}
    for workload in workloads:
        requests = make_requests(workload, engine.core.model_config.vocab_size, seed=0)
        # Every shape the workload launches (prefill chunks, decode at every batch size) in a sixteenth of the time:
        # kernels are compiled and autotuned per shape on first use.
        warm_up(engine, [BenchRequest(r.prompt_token_ids, min(r.output_len, 16)) for r in requests])
        runs = []
        for _ in range(repeats):
            engine.core.kv_cache.reset_prefix_cache()
            result = run_engine(engine, requests)
            runs.append({"tokens_per_s": result.tokens_per_s, "ms_per_token": result.ms_per_token_per_request,
                         "elapsed_s": result.elapsed_s})
        median = sorted(runs, key=lambda r: r["elapsed_s"])[(repeats - 1) // 2]
        out[workload] = {**median, "runs": runs}
    if "W3" in out:
        out["W3"]["floor_ms"] = 1000 * weight_bytes / H200_COPY_BYTES_PER_S
    del engine
    release_device_memory()
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="dummy:llama-8b")
    parser.add_argument("--methods", default="int4,int8,fp8")
    parser.add_argument("--plan", action="append", default=[], metavar="DIR",
                        help="a checkpoint `rtx quantize --plan` wrote (its directory or config.json), laid over "
                             "--model by relative depth; repeatable")
    parser.add_argument("--workloads", default="W3,W1", help="comma-separated subset of W3,W1")
    parser.add_argument("--repeats", type=int, default=1, help="runs of each workload; the median is reported")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    workloads = args.workloads.split(",")
    if set(workloads) - {"W3", "W1"} or args.repeats < 1:
        parser.error("--workloads takes W3 and/or W1, --repeats a positive count")
    try:
        layouts = [read_plan(path) for path in args.plan]
    except ConfigError as exc:
        parser.error(str(exc))
    if not torch.cuda.is_available():
        print("quant_speed needs a CUDA GPU", file=sys.stderr)
        return 2
    print(f"drawing {args.model}'s random weights once...", file=sys.stderr)
    source = HostCopy(resolve_model(args.model))
    registry = load_plugins()
    quantizers: dict[str, Quantizer] = {}

    def quantizer_for(name: str) -> Quantizer:
        if name not in quantizers:
            quantizers[name] = registry.create("quantizer", name)
        return quantizers[name]
    results = []
    # (quantization at load, weights, label, plan path)
    runs: list[tuple[str | None, ModelSource, str | None, str | None]] = \
        [(method, source, None, None) for method in [None, *filter(None, args.methods.split(","))]]
    for path, layout in zip(args.plan, layouts):
        laid_out = LaidOutSource(source, layout, quantizer_for)
        runs.append((None, laid_out, f"plan:{layout.method or 'mixed'}", path))
    for method, weights, label, path in runs:
        print(f"{label or method or 'bf16'}...", file=sys.stderr)
        results.append(measure(weights, method, args.model, workloads, args.repeats, label))
        if isinstance(weights, LaidOutSource):
            results[-1]["plan"] = {"path": path, "layers_by_format": weights.layout.counts(
                source.names(), source.config.num_layers)}
        print(json.dumps(results[-1]), file=sys.stderr, flush=True)  # kept in the log if a later method times out
    base = results[0]
    lines = [f"{'weights':14} {'GB':>6} {'W3 ms/tok':>10} {'vs bf16':>8} {'floor ms':>9} {'W1 tok/s':>10} "
             f"{'vs bf16':>8}  W3 runs (ms/tok)"]
    for r in results:
        w3, w1 = r.get("W3"), r.get("W1")
        line = f"{r['method']:14} {r['weight_bytes'] / 1e9:6.2f} "
        if w3:
            w3["latency_vs_bf16"] = w3["ms_per_token"] / base["W3"]["ms_per_token"]
            line += f"{w3['ms_per_token']:10.3f} {w3['latency_vs_bf16']:7.2f}x {w3['floor_ms']:9.3f} "
        else:
            line += f"{'-':>10} {'-':>8} {'-':>9} "
        if w1:
            w1["throughput_vs_bf16"] = w1["tokens_per_s"] / base["W1"]["tokens_per_s"]
            line += f"{w1['tokens_per_s']:10.0f} {w1['throughput_vs_bf16']:7.2f}x"
        else:
            line += f"{'-':>10} {'-':>8}"
        if w3:
            line += "  " + " ".join(f"{run['ms_per_token']:.3f}" for run in w3["runs"])
        lines.append(line)
    for r in results:
        if "plan" in r:
            lines.append(f"{r['method']}: {r['plan']['path']} laid over {args.model}: "
                         + ", ".join(f"{n} {k}" for k, n in sorted(r["plan"]["layers_by_format"].items())))
    lines.append(f"published: TensorRT-LLM FP8 on one H200, Llama-3.1-8B 128/128 at max load: "
                 f"{TRTLLM_FP8_H200_TOK_S} output tok/s (not measured here)")
    meta = {"command": "python benchmarks/quant_speed.py " + " ".join(sys.argv[1:]),
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "machine": machine_description(), "model": args.model}
    print(f"# {meta['command']}\n# {meta['date']} on {meta['machine']}")
    print("\n".join(lines))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({**meta, "results": results, "trtllm_fp8_h200_tok_s": TRTLLM_FP8_H200_TOK_S}, fh, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
