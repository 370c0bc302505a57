"""``rtx bench``: offline throughput on a standard workload, with its baseline measured in the same run."""

from __future__ import annotations

import argparse
import copy
import dataclasses
import datetime
import json
import platform
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from rtxcore.bench.workloads import (
    MAX_NUM_REQUESTS,
    MAX_PROMPT_TOKENS,
    WORKLOADS,
    BenchRequest,
    Workload,
    get_workload,
    make_requests,
)
from rtxcore.cli.common import (
    add_engine_options,
    engine_cli_args,
    engine_config,
    load_engine,
    output_file,
    positive_int,
)
from rtxcore.cli.progress import Progress
from rtxcore.cli.speculation import describe_stats, stats_since
from rtxcore.engine.speculation.config import SpeculativeConfig
from rtxcore.errors import ConfigError

if TYPE_CHECKING:
    from rtxcore.bench.offline import ThroughputResult
    from rtxcore.bench.serving import ServedResult
    from rtxcore.engine.speculation.speculator import ProposerStats

# Device-to-device copy bandwidth measured on the H200 (docs/workloads.md): the floor W3 is compared with.
H200_COPY_BYTES_PER_S = 4.24e12
# --serve sends every request at once, each from its own streaming client and connection: 16x the largest workload,
# and within the open files a process usually gets, where thousands more would fail as connection errors.
MAX_SERVED_CLIENTS = 4096


def add_parser(sub) -> None:
    p = sub.add_parser("bench", help="measure offline throughput on a workload (docs/workloads.md)")
    p.add_argument("--workload", default="cpu", choices=sorted(WORKLOADS), help="workload name (default: cpu)")
    p.add_argument("--num-requests", type=positive_int, default=None,
                   help=f"override the workload's request count (at most {MAX_NUM_REQUESTS:,}, fewer for workloads "
                        f"of long prompts: {MAX_PROMPT_TOKENS:,} prompt tokens in all)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random prompts and lengths")
    p.add_argument("--baseline", choices=["none", "hf", "static", "unquantized", "plain"], default="none",
                   help="hf: HF transformers eager generate with static batching; static: this engine with static "
                        "batching; unquantized: this engine on the same weights without --quantization; plain: "
                        "this engine without --speculative")
    p.add_argument("--serve", action="store_true",
                   help="also serve the same requests through `rtx serve` to concurrent streaming clients and "
                        "compare served with offline tokens/s (reports TTFT p50/p99)")
    p.add_argument("--json", dest="json_path", type=output_file, default=None,
                   help="also write the results as JSON to this file")
    add_engine_options(p)
    p.set_defaults(run=run)


def machine_description() -> str:
    import torch

    if torch.cuda.is_available():
        return f"{torch.cuda.get_device_name()} ({platform.machine()}, torch {torch.__version__})"
    return f"CPU {_cpu_model()}, {torch.get_num_threads()} threads, torch {torch.__version__}"


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _check_num_requests(workload: Workload, num_requests: int | None, serve: bool) -> None:
    """Refuse, before anything loads, more requests than the run can hold (:attr:`Workload.max_num_requests`) or,
    with --serve, than it can send at once."""
    if num_requests is None:
        return
    if num_requests > workload.max_num_requests:
        raise ConfigError(f"--num-requests {num_requests} is more than {workload.max_num_requests:,}, the most for "
                          f"workload {workload.name} ({MAX_NUM_REQUESTS:,} requests and {MAX_PROMPT_TOKENS:,} "
                          f"prompt tokens in all at most)")
    if serve and num_requests > MAX_SERVED_CLIENTS:
        raise ConfigError(f"--num-requests {num_requests} with --serve is as many concurrent streaming clients; at "
                          f"most {MAX_SERVED_CLIENTS:,}")


def run(args: argparse.Namespace) -> int:
    workload = get_workload(args.workload)
    _check_num_requests(workload, args.num_requests, args.serve)
    # Imported here, not at the top: torch takes seconds, and `rtx --help` imports this module.
    from rtxcore.bench.offline import run_engine, warm_up
    from rtxcore.bench.serving import run_served, summarize
    from rtxcore.engine.speculation.speculator import ProposerStats
    from rtxcore.transfer import release_device_memory

    config = engine_config(args)
    if args.baseline == "unquantized" and not config.quantization:
        raise ConfigError("--baseline unquantized compares against --quantization METHOD: give one")
    if args.baseline == "plain" and not config.speculative.method:
        raise ConfigError("--baseline plain compares against --speculative METHOD: give one")
    engine = load_engine(config)
    requests = make_requests(workload, engine.core.model_config.vocab_size, seed=args.seed,
                             num_requests=args.num_requests, tokenizer=engine.core.tokenizer)
    sys.stderr.write(f"workload {workload.name}: {workload.description} ({len(requests)} requests)\n")
    warm_up(engine, requests, _requests_progress("warm-up"))
    method = config.speculative.method
    # The warm-up speculated too: only the timed run counts.
    before = copy.deepcopy(engine.core.speculator.stats[method]) if method is not None else ProposerStats()
    results: list[ThroughputResult] = [run_engine(engine, requests, progress=_requests_progress("timed run"))]
    sys.stderr.write(f"{results[0].label}: {results[0].tokens_per_s:.1f} output tok/s\n")
    speculation = None
    if method is not None:
        speculation = SpeculationResult(method, results[0].label,
                                        stats_since(before, engine.core.speculator.stats[method]))
    # Decoding one stream reads every weight once per token: no step can take less than that read.
    args.weight_bytes = _weight_bytes(engine)
    args.prefill_attention = None
    if workload.measures_prefill_attention:
        from rtxcore.bench.attention_flops import measure_prefill_attention

        args.prefill_attention = measure_prefill_attention(engine, requests)
    if args.serve:
        del engine  # the server process loads its own copy
        release_device_memory()
        sys.stderr.write(f"serving the same requests to {len(requests)} concurrent streaming clients...\n")
        served = run_served(engine_cli_args(args), requests, _requests_progress("served"))
        print(f"# served: {summarize(served)}")
        # The offline engine is the baseline: the ratio is served / offline tokens per second.
        _report(args, workload.name, [served, results[0]], speculation)
        return 0 if served.errors == 0 else 1
    if args.baseline == "unquantized":
        del engine
        release_device_memory()
        baseline = load_engine(dataclasses.replace(config, quantization=None))
        warm_up(baseline, requests, _requests_progress("baseline warm-up"))
        results.append(run_engine(baseline, requests, label=f"rtx engine ({baseline.core.backend.dtype}, unquantized)",
                                  progress=_requests_progress("baseline")))
        results[0].label = f"rtx engine ({config.quantization})"
    elif args.baseline == "plain":
        del engine
        release_device_memory()
        baseline = load_engine(dataclasses.replace(config, speculative=SpeculativeConfig()))
        warm_up(baseline, requests, _requests_progress("baseline warm-up"))
        results.append(run_engine(baseline, requests, label="rtx engine (plain decoding)",
                                  progress=_requests_progress("baseline")))
        results[0].label = f"rtx engine ({method})"
    elif args.baseline == "static":
        engine.core.kv_cache.reset_prefix_cache()
        warm_up(engine, requests, _requests_progress("baseline warm-up"), static_batching=True)
        results.append(run_engine(engine, requests, label="rtx engine (static batching)", static_batching=True,
                                  progress=_requests_progress("baseline")))
    elif args.baseline == "hf":
        from rtxcore.bench.hf_baseline import load_hf_model, run_hf_static

        device, dtype = engine.core.backend.device, engine.core.backend.dtype
        source = engine.core.source
        del engine
        release_device_memory()  # the engine's KV cache and CUDA graphs, before the baseline allocates its own
        sys.stderr.write("loading the HF transformers baseline on the same weights...\n")
        model = load_hf_model(source, device, dtype)
        # Warm-up on the workload's own batch shape (cuBLAS picks and caches kernels per shape), kept short.
        run_hf_static(model, [BenchRequest(r.prompt_token_ids, min(r.output_len, 16)) for r in requests]
                      if device.type != "cpu" else requests[:1])
        results.append(run_hf_static(model, requests))
    _report(args, workload.name, results, speculation)
    return 0


def _requests_progress(phase: str) -> Progress:
    """Requests finished in one phase, on stderr (stdout carries the results alone)."""
    return Progress(phase, unit="req")


def _weight_bytes(engine) -> int:
    """Bytes of weights one decode step reads (quantized layers at their stored size), for the W3 floor."""
    measured = getattr(engine.core.backend, "weight_bytes", None)
    return measured() if measured else engine.core.model_config.num_params * engine.core.backend.dtype.itemsize


def _number(value: float) -> float | None:
    """JSON has no nan: a figure that was not measured is null."""
    return None if value != value else value


@dataclass(frozen=True, slots=True)
class SpeculationResult:
    method: str
    # The timed run it counts (the offline engine's, also with --serve: the server's counters stay in its process).
    label: str
    stats: ProposerStats

    def line(self) -> str:
        return f"{self.label}: {describe_stats(self.method, self.stats)}"

    def to_json(self) -> dict:
        s = self.stats
        return {"method": self.method, "label": self.label, "num_proposed_tokens": s.num_proposed_tokens,
                "num_accepted_tokens": s.num_accepted_tokens, "num_verifications": s.num_verifications,
                "acceptance_rate": s.acceptance_rate, "mean_accepted_length": s.mean_accepted_length}


def _report(args: argparse.Namespace, workload: str, results: Sequence[ThroughputResult | ServedResult],
            speculation: SpeculationResult | None = None) -> None:
    ours = results[0]
    base = results[1] if len(results) > 1 else None
    lines = [f"{'system':32} {'output tok/s':>12} {'ms/token/stream':>16} {'elapsed s':>10} {'vs baseline':>12} "
             f"{'TTFT p50 s':>11} {'TTFT p99 s':>11}"]
    for r in results:
        ratio = f"{r.tokens_per_s / base.tokens_per_s:.2f}x" if base and r is ours else ("1.00x" if base else "-")
        lines.append(f"{r.label:32} {r.tokens_per_s:12.1f} {r.ms_per_token_per_request:16.2f} {r.elapsed_s:10.2f} "
                     f"{ratio:>12} {r.ttft_percentile(0.5):11.3f} {r.ttft_percentile(0.99):11.3f}")
    # Whether started as `rtx` or `python -m rtxcore.cli.main`, the arguments after the program are the same.
    command = "rtx " + " ".join(sys.argv[1:]) if sys.argv[1:2] == ["bench"] else "rtx bench"
    meta = {
        "command": command,
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": machine_description(),
        "workload": workload,
    }
    import torch

    from rtxcore.bench.serving import ServedResult

    floor_ms = None
    if ours.num_requests == 1 and torch.cuda.is_available() and getattr(args, "weight_bytes", None):
        floor_ms = 1000 * args.weight_bytes / H200_COPY_BYTES_PER_S
        lines.append(f"weight-read floor {floor_ms:.3f} ms/token ({args.weight_bytes / 1e9:.2f} GB at 4.24 TB/s): "
                     f"the engine runs at {floor_ms / ours.ms_per_token_per_request:.0%} of it")
    attention = getattr(args, "prefill_attention", None)
    if attention is not None:
        lines.append(attention.line())
    elif get_workload(workload).measures_prefill_attention:
        lines.append("prefill attention: not measured (it times the Triton prefill kernel: one process on CUDA)")
    if speculation is not None:
        lines.append(speculation.line())
    print(f"# {meta['command']}\n# {meta['date']} on {meta['machine']}")
    print("\n".join(lines))
    if args.json_path:
        payload = {**meta, "results": [
            {"label": r.label, "tokens_per_s": r.tokens_per_s, "output_tokens": r.output_tokens,
             "prompt_tokens": getattr(r, "prompt_tokens", None), "elapsed_s": r.elapsed_s,
             "ms_per_token_per_request": r.ms_per_token_per_request,
             "ttft_p50_s": _number(r.ttft_percentile(0.5)), "ttft_p99_s": _number(r.ttft_percentile(0.99)),
             **({"errors": r.errors} if isinstance(r, ServedResult) else {})} for r in results],
            "ratio_vs_baseline": ours.tokens_per_s / base.tokens_per_s if base else None,
            "weight_read_floor_ms": floor_ms,
            "prefill_attention": attention.to_json() if attention is not None else None,
            "speculative": speculation.to_json() if speculation is not None else None}
        with open(args.json_path, "w") as fh:
            json.dump(payload, fh, indent=2)
