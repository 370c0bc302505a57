"""The disk KV tier's costs, without a model: what a spill cascading from a full host tier into the disk tier costs
the engine's thread, how many blocks per second its writer sustains, and how fast blocks read back on the worker
threads that prefetch them.

    .venv/bin/python benchmarks/disk_tier.py [--blocks 4096] [--block-kib 512] [--rate 0] [--json out.json]

A host tier of 256 slots over a disk tier with room for every block (as in W4's disk configuration, a host tier far
smaller than the disk's), in this process's memory and a temporary directory. The blocks go into the host tier 64 at
a time (a spill's chunk; at ``--rate`` blocks a second, else as fast as the stores return), each store evicting as
many: "engine thread" is the seconds those stores take, "writer" the blocks per second until every file is written
(a flush), "skipped" the blocks the disk tier left out because its writes were behind, "copied on the engine thread"
the blocks the host tier lent the disk tier's writer (written through) and took back before the writer had copied
them (a host tier cycling faster than the writes). Then every block on disk is read back through the tier's reader on
the prefetch's worker threads. To measure another tree, run this file with that tree first on PYTHONPATH (a tree that
never skips reports 0; one without write-through, None copies).
"""

from __future__ import annotations

import argparse
import json
import platform
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timezone
from pathlib import Path

import torch

from rtx_plugins.eviction.lru import LRUPolicy
from rtxcore.kv.tiers.disk import DiskTier
from rtxcore.kv.tiers.host import HostTier
from rtxcore.kv.tiers.prefetch import READ_THREADS

CHUNK = 64
HOST_SLOTS = 256


def key(n: int) -> bytes:
    return n.to_bytes(16, "little")


def run(args) -> dict:
    block_bytes = args.block_kib << 10
    source = torch.randint(0, 256, (CHUNK, block_bytes), dtype=torch.uint8)
    with tempfile.TemporaryDirectory(prefix="disk-tier-bench-") as root:
        disk = DiskTier(Path(root), args.blocks, block_bytes, LRUPolicy(args.blocks), bytes(20))
        host = HostTier(HOST_SLOTS, block_bytes, LRUPolicy(HOST_SLOTS), below=disk)
        engine_s = 0.0
        start = time.perf_counter()
        for first in range(0, args.blocks + HOST_SLOTS, CHUNK):
            source[:, 0] = first % 251  # each chunk's bytes differ
            if args.rate:  # this chunk's time at the offered rate
                time.sleep(max(0.0, start + first / args.rate - time.perf_counter()))
            began = time.perf_counter()
            host.store([key(n) for n in range(first, first + CHUNK)], source)
            engine_s += time.perf_counter() - began
        disk.flush()
        written_s = time.perf_counter() - start
        stored = len(disk)
        skipped = getattr(disk.stats, "num_skipped_busy", 0)
        engine_copies = getattr(host.stats, "num_lent_copies", None)  # None: a tree before write-through
        keys = disk.keys()
        for k in keys:
            disk.pin(k)
        began = time.perf_counter()
        with ThreadPoolExecutor(READ_THREADS) as pool:
            rows = list(pool.map(lambda read: read(), [disk.reader(k, False) for k in keys]))
        read_s = time.perf_counter() - began
        for k in keys:
            disk.unpin(k)
        assert all(row.numel() == block_bytes for row in rows)
    return {"blocks_to_disk": args.blocks, "block_kib": args.block_kib, "offered_blocks_per_s": args.rate or None,
            "engine_thread_s": round(engine_s, 3),
            "engine_thread_us_per_block": round(1e6 * engine_s / max(stored + skipped, 1), 1),
            "stored_on_disk": stored, "skipped": skipped, "copied_on_the_engine_thread": engine_copies,
            "writer_blocks_per_s": round(stored / written_s, 1), "written_mib_per_s": round(
                stored * args.block_kib / 1024 / written_s, 1),
            "read_blocks_per_s": round(len(keys) / read_s, 1), "read_mib_per_s": round(
                len(keys) * args.block_kib / 1024 / read_s, 1)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--blocks", type=int, default=4096, help="blocks spilled through the host tier into the disk tier")
    p.add_argument("--block-kib", type=int, default=512, help="bytes per block, in KiB (llama-1b, bf16: 512)")
    p.add_argument("--rate", type=float, default=0.0,
                   help="blocks per second offered (0: as fast as the stores return)")
    p.add_argument("--json", default=None, help="also write the results here")
    args = p.parse_args()
    result = run(args)
    report = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
              "machine": f"{platform.processor() or platform.machine()}, torch {torch.__version__}", **result}
    print(json.dumps(report, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
