"""KV tier copies on a GPU: one row-copy launch against one copy per run of adjacent host slots.

    python3 benchmarks/row_copy.py [--rows 128] [--row-kib 512] [--runs 21] [--repeats 50] [--json PATH]

A reload of ``--rows`` blocks from scattered slots of a pinned host buffer (in ``--runs`` runs of adjacent slots,
as a W4 reload's 2k-token history lay on the H200), and a spill of as many rows into free slots the other way. For
each direction and way of copying: the engine thread's time to queue one batch (what a step waits for) and the
device's time to move it (GB/s over the host link). Needs a CUDA GPU and Triton.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

import torch

from rtx_kernels.row_copy import copy_rows


def _slots(num_rows: int, num_runs: int, rng: random.Random) -> list[int]:
    """``num_rows`` distinct slots in ``num_runs`` runs of adjacent ones (a free slot between two runs), the runs
    in random order."""
    cuts = sorted(rng.sample(range(1, num_rows), num_runs - 1))
    runs, start = [], 0
    for a, b in zip([0, *cuts], [*cuts, num_rows]):
        runs.append(list(range(start, start + b - a)))
        start += b - a + 1
    rng.shuffle(runs)
    return [slot for run in runs for slot in run]


def _copy_by_runs(host: torch.Tensor, slots: list[int], device_rows: torch.Tensor, to_device: bool) -> None:
    i = 0
    while i < len(slots):
        j = i + 1
        while j < len(slots) and slots[j] == slots[i] + (j - i):
            j += 1
        if to_device:
            device_rows[i:j].copy_(host[slots[i]:slots[j - 1] + 1], non_blocking=True)
        else:
            host[slots[i]:slots[j - 1] + 1].copy_(device_rows[i:j], non_blocking=True)
        i = j


def _copy_by_kernel(host: torch.Tensor, slots: list[int], device_rows: torch.Tensor, to_device: bool,
                    cache: dict, num_programs: int) -> None:
    """As the KV tiers do it: addresses computed from the slots, no view per row."""
    width = host.shape[1]
    host_addrs = [host.data_ptr() + s * width for s in slots]
    dev_addrs = [device_rows.data_ptr() + i * width for i in range(len(slots))]
    src, dst = (host_addrs, dev_addrs) if to_device else (dev_addrs, host_addrs)
    addrs = torch.tensor([src, dst], dtype=torch.int64, pin_memory=True).cuda(non_blocking=True)
    copy_rows(addrs[0], addrs[1], width, cache, num_programs)


def measure(way: str, to_device: bool, host: torch.Tensor, slots: list[int], repeats: int) -> dict:
    """``way``: "runs" (copy engines) or "kernel/P" (the row-copy kernel on at most P programs)."""
    rows = torch.empty((len(slots), host.shape[1]), dtype=torch.uint8, device="cuda")
    cache: dict = {}
    host_s, device_ms = [], []
    for i in range(repeats + 3):
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        t0 = time.perf_counter()
        if way.startswith("kernel"):
            _copy_by_kernel(host, slots, rows, to_device, cache, int(way.split("/")[1]))
        else:
            _copy_by_runs(host, slots, rows, to_device)
        t1 = time.perf_counter()
        end.record()
        end.synchronize()
        if i >= 3:  # the first launches compile and warm up
            host_s.append(t1 - t0)
            device_ms.append(start.elapsed_time(end))
    assert torch.equal(rows.cpu(), host[slots]), f"{way}: rows arrived damaged"
    nbytes = len(slots) * host.shape[1]
    return {"way": way, "direction": "to device" if to_device else "to host",
            "host_us_p50": statistics.median(host_s) * 1e6, "device_ms_p50": statistics.median(device_ms),
            "gb_per_s": nbytes / (statistics.median(device_ms) / 1e3) / 1e9}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=128)
    parser.add_argument("--row-kib", type=int, default=512)
    parser.add_argument("--runs", type=int, default=21)
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--programs", default="16,32,64,132", help="grid bounds of the kernel to measure")
    parser.add_argument("--json")
    args = parser.parse_args()
    slots = _slots(args.rows, args.runs, random.Random(0))
    host = torch.randint(0, 256, (max(slots) + 1, args.row_kib * 1024), dtype=torch.uint8).pin_memory()
    results = [measure(way, to_device, host, slots, args.repeats)
               for to_device in (True, False)
               for way in ["runs", *(f"kernel/{p}" for p in args.programs.split(","))]]
    print(f"{args.rows} rows of {args.row_kib} KiB in {args.runs} runs of adjacent slots,",
          torch.cuda.get_device_name())
    print("| direction | way | engine thread, us | device, ms | GB/s |\n|---|---|---:|---:|---:|")
    for r in results:
        print(f"| {r['direction']} | {r['way']} | {r['host_us_p50']:.0f} | {r['device_ms_p50']:.3f} |",
              f"{r['gb_per_s']:.1f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
