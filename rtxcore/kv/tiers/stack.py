"""The engine's lower KV tiers, built from its config: host memory and disk under the device's prefix cache, and
the warm-restart snapshots kept in the disk tier."""

from __future__ import annotations

import json
import logging
import time
from dataclasses import asdict
from pathlib import Path

from rtxcore.contracts.backend import ExecutionBackend
from rtxcore.engine.config import EngineConfig
from rtxcore.errors import ConfigError
from rtxcore.kv.manager import KVCacheManager
from rtxcore.kv.tiers.base import KVTier
from rtxcore.kv.tiers.disk import DiskTier
from rtxcore.kv.tiers.host import HostTier
from rtxcore.kv.tiers.offload import KVOffload
from rtxcore.kv.tiers.snapshot import cache_fingerprint, copy_to_disk, load_snapshot, write_index
from rtxcore.models.fingerprint import weights_fingerprint
from rtxcore.models.source import ModelSource
from rtxcore.registry import PluginRegistry

log = logging.getLogger("rtx.kv")


class KVTiers:
    def __init__(self, config: EngineConfig, backend: ExecutionBackend, registry: PluginRegistry,
                 source: ModelSource):
        caps = type(backend).capabilities()
        if not caps.kv_offload:
            raise ConfigError(f"backend {config.backend!r} cannot copy KV blocks out and back, which KV tiers need "
                              "(--kv-host-bytes, --kv-disk-dir, or --state-dir, which puts a disk tier under it); "
                              "with --state-dir, pass --no-prefix-caching to keep only the journal")
        self.config = config
        self.block_bytes = backend.kv_cache_bytes_per_token() * config.block_size
        self.host: HostTier | None = None
        self.disk: DiskTier | None = None
        self.identity: dict = {}
        tiers: list[KVTier] = []
        if config.kv_host_bytes:
            slots = self._slots("host", config.kv_host_bytes)
            policy = registry.create("eviction_policy", config.kv_host_eviction_policy or config.eviction_policy,
                                     slots)
            self.host = HostTier(slots, self.block_bytes, policy, pin_memory=backend.device.type == "cuda")
            tiers.append(self.host)
        if config.kv_disk_dir:
            slots = self._slots("disk", config.kv_disk_bytes)
            policy = registry.create("eviction_policy", config.kv_disk_eviction_policy or config.eviction_policy,
                                     slots)
            # Round-tripped through JSON so it compares equal to the copy a snapshot's index holds.
            self.identity = json.loads(json.dumps({
                "weights": weights_fingerprint(source), "quantization": config.quantization,
                "model": asdict(backend.model_config),
                "backend": config.backend, "dtype": str(getattr(backend, "dtype", config.dtype)),
                "block_size": config.block_size, "block_bytes": self.block_bytes}, default=str))
            self.disk = DiskTier(Path(config.kv_disk_dir), slots, self.block_bytes, policy,
                                 cache_fingerprint(self.identity))
            tiers.append(self.disk)
        self.offload = KVOffload(tiers, backend.read_kv_blocks, backend.write_kv_blocks, backend.device)
        self._read_blocks = backend.read_kv_blocks
        self._last_snapshot = time.monotonic()
        # Blocks written by snapshots since start, and the disk tier's change count the index last described.
        self.num_snapshot_blocks = 0
        self._indexed_changes = -1

    @property
    def tiers(self) -> list[KVTier]:
        return self.offload.tiers

    def load_snapshot(self) -> int:
        return load_snapshot(self.disk, self.identity) if self.disk is not None else 0

    def save_snapshot(self, kv_cache: KVCacheManager) -> int:
        """Write the prefix cache to the disk tier with its index; 0 without a disk tier."""
        if self.disk is None:
            return 0
        start = time.monotonic()
        try:
            written = copy_to_disk(self.disk, kv_cache.cached_blocks(), self._read_blocks, self.host)
            self.disk.flush()  # the index lists only blocks whose files are there
            # The index is rewritten only when the disk tier changed (blocks also reach it between snapshots).
            if self.disk.num_changes != self._indexed_changes:
                write_index(self.disk, self.identity)
                self._indexed_changes = self.disk.num_changes
        except OSError as exc:  # a full or failing disk: the next snapshot tries again, serving goes on
            log.warning("KV cache snapshot to %s failed: %s", self.disk.root, exc)
            return 0
        finally:
            self._last_snapshot = time.monotonic()
        self.num_snapshot_blocks += written
        # Quiet when nothing changed: an idle server snapshots every interval.
        log.log(logging.INFO if written else logging.DEBUG,
                "KV cache snapshot: %d new blocks written to %s in %.2fs (%d blocks there)", written, self.disk.root,
                self._last_snapshot - start, len(self.disk))
        return written

    def snapshot_due(self, now: float) -> bool:
        interval = self.config.kv_snapshot_interval_s
        return self.disk is not None and interval > 0 and now - self._last_snapshot >= interval

    def _slots(self, tier: str, num_bytes: int) -> int:
        slots = num_bytes // self.block_bytes
        if slots < 1:
            raise ConfigError(f"the {tier} KV tier's {num_bytes} bytes hold no block of {self.block_bytes} bytes")
        return slots
