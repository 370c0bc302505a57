"""What the KV offload did: blocks moved each way, the steps that waited, and what it cost the engine's thread
(read by the engine's metrics, rtxcore.metrics.engine_metrics, and by ``benchmarks/w4_tiers.py``)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class OffloadStats:
    # Device blocks spilled to the first lower tier (copied), and those a lower tier already held (no copy).
    num_spilled: int = 0
    num_spill_hits: int = 0
    # Device blocks copied to the first lower tier ahead of their eviction (rtxcore.kv.tiers.write_back).
    num_written_back: int = 0
    # Blocks brought back to the device, and the requests' tokens they covered.
    num_reloaded: int = 0
    # Steps that waited for a reload's bytes, and for how long in all: on a GPU, those whose stream reached a
    # reload's bytes before they had arrived (timed on the device); on a CPU, every step with a reload (it copies
    # between the steps).
    num_copy_wait_steps: int = 0
    copy_wait_seconds: float = 0.0
    # Blocks read from a slow tier (disk) on worker threads, and of those, the ones no reload used (their request
    # left first, or went ahead without them): they went up to the first tier instead.
    num_prefetched: int = 0
    num_prefetches_promoted: int = 0
    # Seconds the engine's thread spent copying blocks down (spills, write-backs) and queuing reloads (reload and
    # complete): what the tiers cost the host, waits for the GIL included.
    copy_down_host_seconds: float = 0.0
    reload_host_seconds: float = 0.0
