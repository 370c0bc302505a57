"""ONNX Runtime backend against the torch backend on the CPU: the same offline workload through the same engine,
in one run, and what the export costs on a first start and a second one.

    .venv/bin/python benchmarks/graph_backends_cpu.py --workload cpu --num-requests 16

The first onnxruntime start exports into a fresh cache directory (unless --cache-dir names one that already holds
the export); the second start must find it there. Both engines then run the workload, greedy, after an untimed
warm-up; the ratio is onnxruntime / torch output tokens per second.

    .venv/bin/python benchmarks/graph_backends_cpu.py --fp8-quality [--tokens 512]

instead measures the onnxruntime backend's perplexity on the quality gate's evaluation text, float32 against the
fp8 Q/DQ export (the graph the tensorrt backend builds in fp8), each exported into a fresh cache.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import sys
import tempfile
import time

from rtx_plugins.backends.graph_runtime.cache import CACHE_DIR_ENV
from rtxcore.bench.engine import Engine, build_engine
from rtxcore.bench.offline import run_engine, warm_up
from rtxcore.bench.workloads import WORKLOADS, make_requests
from rtxcore.cli.bench import machine_description


def _start(backend: str, model: str | None) -> tuple[Engine, float]:
    start = time.perf_counter()
    engine = build_engine(model=model, backend=backend)
    return engine, time.perf_counter() - start


def fp8_quality(tokens: int) -> int:
    from rtxcore.models.resolve import resolve_model
    from rtxcore.quant.evaluation import backend_perplexity
    from rtxcore.quant.pipeline import evaluation_tokens

    source = resolve_model(None)
    ids = evaluation_tokens(source, tokens)
    for quantization in (None, "fp8"):
        with tempfile.TemporaryDirectory(prefix="rtx-graphs-") as tmp:
            os.environ[CACHE_DIR_ENV] = tmp
            engine = build_engine(backend="onnxruntime", quantization=quantization, num_kv_blocks=64, source=source)
            ppl = backend_perplexity(engine.core.backend, ids, tokens)
            export_s = engine.core.backend.graph.export_s
            print(f"{quantization or 'float32':8} perplexity {ppl:.3f}  export {export_s:.1f} s")
            del engine
            gc.collect()
    return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workload", default="cpu", choices=sorted(WORKLOADS))
    p.add_argument("--num-requests", type=int, default=None)
    p.add_argument("--model", default=None, help="as rtx --model (default: smollm2-135m)")
    p.add_argument("--cache-dir", default=None, help="graph cache to use (default: a fresh temporary directory)")
    p.add_argument("--json", dest="json_path", default=None)
    p.add_argument("--fp8-quality", action="store_true",
                   help="measure float32 against fp8 Q/DQ export perplexity instead of throughput")
    p.add_argument("--tokens", type=int, default=512, help="evaluation tokens of --fp8-quality")
    args = p.parse_args()
    if args.fp8_quality:
        return fp8_quality(args.tokens)

    with tempfile.TemporaryDirectory(prefix="rtx-graphs-") as tmp:
        os.environ[CACHE_DIR_ENV] = args.cache_dir or tmp
        first, first_start_s = _start("onnxruntime", args.model)
        first_graph = first.backend.graph
        del first
        gc.collect()
        ort, second_start_s = _start("onnxruntime", args.model)
        second_graph = ort.backend.graph
        torch_engine, torch_start_s = _start("torch", args.model)

        requests = make_requests(args.workload, ort.model_config.vocab_size, num_requests=args.num_requests)
        results = {}
        for label, engine in (("onnxruntime", ort), ("torch", torch_engine)):
            warm_up(engine)
            results[label] = run_engine(engine, requests, label=label)
            sys.stderr.write(f"{label}: {results[label].tokens_per_s:.1f} output tok/s\n")

    ratio = results["onnxruntime"].tokens_per_s / results["torch"].tokens_per_s
    meta = {"command": "python " + " ".join(sys.argv),
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "machine": machine_description(), "workload": args.workload, "num_requests": len(requests)}
    print(f"# {meta['command']}\n# {meta['date']} on {meta['machine']}")
    print(f"# workload {args.workload}: {len(requests)} requests, "
          f"{sum(len(r.prompt_token_ids) for r in requests)} prompt tokens")
    print(f"{'backend':12} {'output tok/s':>12} {'elapsed s':>10} {'vs torch':>9} {'start s':>8}")
    for label, start_s in (("onnxruntime", second_start_s), ("torch", torch_start_s)):
        r = results[label]
        ratio = r.tokens_per_s / results['torch'].tokens_per_s
        print(f"{label:12} {r.tokens_per_s:12.1f} {r.elapsed_s:10.2f} {ratio:8.2f}x"
              f" {start_s:8.1f}")
    print(f"onnxruntime first start:  {first_start_s:.1f}s (cache hit: {first_graph.cache_hit}, export "
          f"{first_graph.export_s:.1f}s, weights hash {first_graph.fingerprint_s:.2f}s)")
    print(f"onnxruntime second start: {second_start_s:.1f}s (cache hit: {second_graph.cache_hit}, export "
          f"{second_graph.export_s:.1f}s, session {ort.backend.session_s:.1f}s)")
    if args.json_path:
        with open(args.json_path, "w") as fh:
            json.dump({**meta, "ratio_onnxruntime_vs_torch": ratio,
                       "results": {k: {"tokens_per_s": r.tokens_per_s, "output_tokens": r.output_tokens,
                                       "elapsed_s": r.elapsed_s} for k, r in results.items()},
                       "first_start": {"seconds": first_start_s, "cache_hit": first_graph.cache_hit,
                                       "export_s": first_graph.export_s},
                       "second_start": {"seconds": second_start_s, "cache_hit": second_graph.cache_hit,
                                        "export_s": second_graph.export_s}}, fh, indent=2)
    return 0 if second_graph.cache_hit else 1


if __name__ == "__main__":
    sys.exit(main())
