"""Where an offline run's time goes, step by step: continuous against static batching on one workload.

Every ``schedule()`` of the engine is recorded with the step it made (rows, prompt tokens beside the decodes, the
context the step's attention reads) and the time to the next one. In the overlapped engine a step's device work
shows in the return after the next launch, so each gap is put to the step scheduled one before it. Steps are then
grouped by kind (decodes only, or decodes beside prompt tokens) and by rows, for the continuous run and the static
baseline of the same engine in the same process, the way `rtx bench --baseline static` runs them (each warmed up
by one untimed run of its own).

    python benchmarks/step_breakdown.py --workload W2 --model dummy:llama-1b --max-num-seqs 64 \
        --max-num-batched-tokens 8192 --max-model-len 4096 [--json F]

Every `rtx bench` engine option is taken. ``--steady 64x830`` also holds 64 requests of 830-token contexts decoding
(on a CUDA device): the engine's step time on the host against one replay of its decode graph timed on the device,
which tells a host-bound step from a device-bound one, and the replay's kernels under the torch profiler; and the
host's time a step in each phase of the overlapped step (scheduling, building, launching, sampling, waiting for the
device, making outputs): where a host-bound step's time goes. On a CPU the phases alone are timed.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import defaultdict
from dataclasses import asdict, dataclass

from rtxcore.bench.offline import run_engine, warm_up
from rtxcore.bench.workloads import WORKLOADS, get_workload, make_requests
from rtxcore.cli.bench import machine_description
from rtxcore.cli.common import add_engine_options, engine_config, load_engine


@dataclass(slots=True)
class StepRecord:
    at: float  # perf_counter at its schedule()
    rows: int
    prompt_tokens: int  # tokens of requests past their first step's single token: prefill chunks
    context_tokens: int  # tokens the step's attention reads (every row's context, its new tokens included)
    preempted: int


@dataclass(slots=True)
class Group:
    steps: int = 0
    seconds: float = 0.0
    rows: int = 0
    prompt_tokens: int = 0
    context_tokens: int = 0

    def add(self, r: StepRecord, seconds: float) -> None:
        self.steps += 1
        self.seconds += seconds
        self.rows += r.rows
        self.prompt_tokens += r.prompt_tokens
        self.context_tokens += r.context_tokens


def record_steps(engine) -> list[StepRecord]:
    """Wrap the engine core's ``schedule`` so that each step it makes is appended to the returned list."""
    core, records = engine.core, []
    schedule = core.schedule

    def recorded():
        sched = schedule()
        if not sched.is_empty:
            decodes = sum(1 for n in sched.num_scheduled_tokens if n == 1)
            prompt = sched.total_num_scheduled_tokens - decodes
            context = sum(r.num_computed_tokens + n for r, n in zip(sched.scheduled, sched.num_scheduled_tokens))
            records.append(StepRecord(time.perf_counter(), len(sched.scheduled), prompt, context,
                                      len(sched.preempted)))
        return sched

    core.schedule = recorded
    return records


def breakdown(records: list[StepRecord], end: float) -> dict:
    """Group the steps; step i is charged the gap from schedule i+1 to schedule i+2, the last two steps the gap from
    the last schedule to the run's end, split evenly (the first gap, before any step's device work shows, is left
    out)."""
    times = [r.at for r in records] + [end]
    gaps = [times[i + 1] - times[i] for i in range(len(records))]
    charged = gaps[1:] + [0.0]
    if len(records) >= 2:
        charged[-2] = charged[-1] = gaps[-1] / 2
    kinds: dict[str, Group] = defaultdict(Group)
    by_rows: dict[tuple[str, int], Group] = defaultdict(Group)
    for r, s in zip(records, charged):
        kind = "mixed" if r.prompt_tokens else "decode"
        kinds[kind].add(r, s)
        by_rows[kind, 1 << max(0, (r.rows - 1).bit_length())].add(r, s)  # rows rounded up to a power of two
    return {"steps": len(records), "seconds": sum(charged), "preempted": sum(r.preempted for r in records),
            "kinds": {k: asdict(g) for k, g in sorted(kinds.items())},
            "by_rows": {f"{kind} <= {rows} rows": asdict(g) for (kind, rows), g in sorted(by_rows.items())}}


def run(engine, requests, static: bool) -> dict:
    warm_up(engine, requests, static_batching=static)  # each batching makes steps of its own shapes
    records = record_steps(engine)
    result = run_engine(engine, requests, static_batching=static)
    summary = breakdown(records, time.perf_counter())
    del engine.core.schedule  # the wrapper goes: the class's own method shows again
    engine.core.kv_cache.reset_prefix_cache()
    summary.update(tokens_per_s=result.tokens_per_s, elapsed_s=result.elapsed_s, output_tokens=result.output_tokens)
    return summary


def steady_decode(engine, rows: int, context: int, replays: int = 50, steps: int = 40) -> dict:
    """``rows`` requests with ``context``-token prompts decoding together: the median engine step on the host, the
    host's mean time a step in each phase (:func:`host_phases`), and on a CUDA device one decode graph replay and
    its kernels, largest first."""
    import torch

    from rtxcore.sampling_params import SamplingParams

    cuda = torch.device(engine.core.backend.device).type == "cuda"
    params = SamplingParams(max_tokens=2 * steps + 40, temperature=0.0, ignore_eos=True)
    vocab = engine.core.model_config.vocab_size
    for i in range(rows):
        engine.add_request([(1000 + (i * 7 + j) % 5000) % vocab for j in range(context)], params)
    budget = engine.core.config.scheduling.max_num_batched_tokens
    for _ in range(-(-rows * context // budget) + 6):  # the prompts' chunks, then a few decodes
        engine.step()
    if cuda:
        torch.cuda.synchronize()
    host = []
    for _ in range(steps):
        t = time.perf_counter()
        engine.step()
        host.append(time.perf_counter() - t)
    phases = host_phases(engine, steps)
    trace = engine_trace(engine, 10) if cuda else None
    while engine.has_unfinished_requests():
        engine.step()
    engine.core.kv_cache.reset_prefix_cache()
    host.sort()
    report = {"rows": rows, "context": context, "engine_step_ms_median": 1000 * host[len(host) // 2],
              "host_phases_ms": phases}
    if cuda:
        from gpu_checks import decode_graph, replay_kernels, replay_ms  # this folder's GPU helpers

        graph = decode_graph(engine, rows)
        report["graph_replay_ms"] = replay_ms(graph, replays)
        report["kernels"] = [{"name": n, "us": us, "launches": c} for n, us, c in replay_kernels(graph, replays)]
        report["engine_trace"] = trace
    return report


def engine_trace(engine, steps: int) -> dict:
    """``steps`` engine steps under the torch profiler (host and device): the host's operations and the device's
    work (the graph's kernels and everything outside it), µs a step each, largest first; what the step does that a
    bare graph replay does not."""
    import torch

    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                            torch.profiler.ProfilerActivity.CUDA]) as prof:
        t = time.perf_counter()
        for _ in range(steps):
            engine.step()
        wall = time.perf_counter() - t
        torch.cuda.synchronize()
    events = prof.key_averages()
    host = sorted(((e.key, e.self_cpu_time_total / steps, e.count / steps) for e in events
                   if e.self_cpu_time_total > 0), key=lambda r: -r[1])
    device = sorted(((e.key, e.self_device_time_total / steps, e.count / steps) for e in events
                     if e.self_device_time_total > 0), key=lambda r: -r[1])
    return {"step_ms": 1000 * wall / steps,
            "host": [{"name": n, "us": us, "calls": c} for n, us, c in host[:25]],
            "device": [{"name": n, "us": us, "calls": c} for n, us, c in device[:25]]}


def host_phases(engine, steps: int) -> dict[str, float]:
    """The host's mean milliseconds a step in each phase of ``steps`` engine steps: the engine core's methods
    (and the overlapped step's ``build_step`` and its wait for the previous step's tokens) wrapped in timers, then
    unwrapped. ``wait`` is the host blocked on the device; the rest is its own work."""
    import rtxcore.engine.overlap as overlap
    from rtxcore.engine.in_flight import InFlightStep

    core = engine.core
    totals: dict[str, float] = defaultdict(float)

    def timed(name: str, fn):
        def wrapper(*args, **kwargs):
            t = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                totals[name] += time.perf_counter() - t
        return wrapper

    # (owner, attribute, phase): instance attributes shadow the class's methods and are deleted afterwards; the
    # module function and the class method are put back as they were.
    instance = [(core, "maintain", "maintain"), (core, "schedule", "schedule"),
                (core.kv_cache, "prepare_step", "prepare_step"), (core.faults, "execute", "execute (forward launch)"),
                (core.faults, "sample", "sample (launch)"), (core, "update", "update (outputs)")]
    for owner, attr, name in instance:
        setattr(owner, attr, timed(name, getattr(owner, attr)))
    build, wait = overlap.build_step, InFlightStep.wait
    overlap.build_step = timed("build_step", build)
    InFlightStep.wait = timed("wait (for the device)", wait)  # type: ignore[method-assign]
    try:
        t = time.perf_counter()
        for _ in range(steps):
            engine.step()
        totals["step"] = time.perf_counter() - t
    finally:
        for owner, attr, _ in instance:
            delattr(owner, attr)
        overlap.build_step, InFlightStep.wait = build, wait  # type: ignore[method-assign]
    phases = {name: 1000 * seconds / steps for name, seconds in totals.items()}
    phases["rest"] = phases["step"] - sum(v for k, v in phases.items() if k != "step")
    return phases


def print_table(name: str, s: dict) -> None:
    print(f"## {name}: {s['tokens_per_s']:.1f} tok/s, {s['elapsed_s']:.3f} s, {s['steps']} steps, "
          f"{s['preempted']} preempted")
    print("| steps | count | seconds | ms a step | rows a step | prompt tokens a step | context tokens a step |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for key, g in list(s["kinds"].items()) + list(s["by_rows"].items()):
        n = max(g["steps"], 1)
        print(f"| {key} | {g['steps']} | {g['seconds']:.3f} | {1000 * g['seconds'] / n:.3f} | {g['rows'] / n:.1f} "
              f"| {g['prompt_tokens'] / n:.1f} | {g['context_tokens'] / n:.0f} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workload", default="W2", choices=sorted(WORKLOADS))
    ap.add_argument("--num-requests", type=int, default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", dest="json_path", default=None)
    ap.add_argument("--steady", default=None, metavar="ROWSxCONTEXT[,...]",
                    help="also time a steady decode of ROWS requests of CONTEXT tokens (its graph replay: CUDA only)")
    add_engine_options(ap)
    args = ap.parse_args()
    engine = load_engine(engine_config(args))
    workload = get_workload(args.workload)
    requests = make_requests(workload, engine.core.model_config.vocab_size, seed=args.seed,
                             num_requests=args.num_requests, tokenizer=engine.core.tokenizer)
    report = {"machine": machine_description(), "argv": sys.argv[1:],
              "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
              "continuous": run(engine, requests, static=False), "static": run(engine, requests, static=True)}
    report["ratio"] = report["continuous"]["tokens_per_s"] / report["static"]["tokens_per_s"]
    print(f"# {report['machine']}, {report['date']}: continuous / static {report['ratio']:.3f}x")
    print_table("continuous", report["continuous"])
    print_table("static", report["static"])
    for shape in args.steady.split(",") if args.steady else ():
        rows, context = (int(x) for x in shape.split("x"))
        steady = steady_decode(engine, rows, context)
        report.setdefault("steady", []).append(steady)
        replay = (f", decode graph replay {steady['graph_replay_ms']:.3f} ms (device)"
                  if "graph_replay_ms" in steady else "")
        print(f"## steady decode, {rows} rows of {context} tokens: engine step {steady['engine_step_ms_median']:.3f} "
              f"ms (host, median){replay}")
        print("host, mean ms a step: " + ", ".join(f"{k} {v:.3f}" for k, v in steady["host_phases_ms"].items()))
        if steady.get("engine_trace"):
            trace = steady["engine_trace"]
            print(f"engine steps under the profiler: {trace['step_ms']:.3f} ms a step")
            for side in ("host", "device"):
                for e in trace[side][:15]:
                    print(f"  {side} {e['us']:8.1f} us  x{e['calls']:<5.1f} {e['name'][:100]}")
        if "kernels" in steady:
            print(f"kernels of a replay: {sum(k['us'] for k in steady['kernels']):.1f} us")
            for k in steady["kernels"][:20]:
                print(f"  {k['us']:8.1f} us  x{k['launches']:<3} {k['name'][:100]}")
    if args.json_path:
        with open(args.json_path, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
