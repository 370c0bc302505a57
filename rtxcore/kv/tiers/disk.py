"""The disk KV tier: one file per block under a directory, which outlives the process (the warm-restart snapshot
is this tier plus an index, see ``rtxcore.kv.tiers.snapshot``).

Each file starts with a header naming what it holds: a magic string, the *cache fingerprint* (model weights and
shape, backend, dtype and block size: what makes two servers' KV bytes interchangeable), the block's key, its
length and a checksum of the bytes. A file whose header or checksum does not match is never loaded; it is deleted
and the block counts as missing.

Files are written to a temporary name and renamed, so a crash leaves either the whole file or none. They are not
fsynced one by one: losing a cache entry to a power cut costs a recomputation, not correctness. The storage calls
are the only thing that knows about files, to leave room for NVMe queues or GPUDirect Storage behind the same tier.
"""

from __future__ import annotations

import logging
import struct
from collections.abc import Callable
from functools import partial
from hashlib import blake2b
from pathlib import Path

import torch

from rtxcore.contracts.eviction import EvictionPolicy
from rtxcore.files import replace_atomically
from rtxcore.kv.hashing import HASH_SIZE, BlockHash
from rtxcore.kv.tiers.base import KVTier, TierReadError

log = logging.getLogger("rtx.kv")

MAGIC = b"RTXKVB01"
FINGERPRINT_SIZE = 20
# magic, fingerprint, key, payload length, payload checksum
_HEADER = struct.Struct(f"<8s{FINGERPRINT_SIZE}s{HASH_SIZE}sQ16s")
SUFFIX = ".kvb"


def checksum(data: bytes | memoryview) -> bytes:
    return blake2b(data, digest_size=16).digest()


class DiskTier(KVTier):
    def __init__(self, root: Path, num_slots: int, block_bytes: int, policy: EvictionPolicy, fingerprint: bytes):
        super().__init__("disk", num_slots, block_bytes, policy)
        if len(fingerprint) != FINGERPRINT_SIZE:
            raise ValueError(f"fingerprint must be {FINGERPRINT_SIZE} bytes")
        self.root = root
        self.fingerprint = fingerprint
        self.blocks_dir = root / "blocks"
        self.blocks_dir.mkdir(parents=True, exist_ok=True)

    def store(self, keys: list[BlockHash], data: torch.Tensor) -> None:
        super().store(keys, data.cpu())  # one copy from the device for the batch, not one per file

    def path(self, key: BlockHash) -> Path:
        name = key.hex()
        return self.blocks_dir / name[:2] / (name + SUFFIX)

    def adopt(self, key: BlockHash) -> bool:
        """Take an existing file into the tier (a warm start) if its header names this cache and key; a file that
        does not match is deleted. False when it was not taken (no room, missing, or foreign)."""
        if key in self or not self._free:
            return False
        path = self.path(key)
        try:
            with open(path, "rb") as fh:
                header = fh.read(_HEADER.size)
            self._check_header(header, key)
        except FileNotFoundError:
            return False
        except (OSError, TierReadError) as exc:
            log.warning("dropping KV block file %s: %s", path, exc)
            path.unlink(missing_ok=True)
            return False
        slot = self._free.pop()
        self.num_changes += 1
        self._slot_of[key] = slot
        self._key_of[slot] = key
        self.policy.cached(slot, key)
        self.policy.add(slot)
        return True

    def files(self) -> list[Path]:
        return sorted(self.blocks_dir.glob(f"*/*{SUFFIX}"))

    def _write(self, slot: int, key: BlockHash, data: torch.Tensor) -> None:
        payload = data.contiguous().numpy().tobytes()
        path = self.path(key)
        path.parent.mkdir(exist_ok=True)
        header = _HEADER.pack(MAGIC, self.fingerprint, key, len(payload), checksum(payload))
        replace_atomically(path, header + payload, durable=False)

    # A block file is read and checked in milliseconds (a page-cache hit still copies and hashes it): too long for
    # the engine's thread, which would hold every running request's next step meanwhile.
    reads_in_background = True

    def reader(self, key: BlockHash, pin_memory: bool) -> Callable[[], torch.Tensor]:
        # The path is fixed while the key is pinned; the call reads only the file and the tier's constants.
        return partial(self._read_file, self.path(key), key, pin_memory)

    def _read(self, slot: int, key: BlockHash) -> torch.Tensor:
        return self._read_file(self.path(key), key, False)

    def _read_file(self, path: Path, key: BlockHash, pin_memory: bool) -> torch.Tensor:
        try:
            with open(path, "rb") as fh:
                header = fh.read(_HEADER.size)
                length = self._check_header(header, key)
                if length != self.block_bytes:
                    raise TierReadError(f"{path} says it holds {length} bytes, expected {self.block_bytes}")
                # Straight into the (pinned, where asked) tensor that the copy to the device reads.
                data = torch.empty(length, dtype=torch.uint8, pin_memory=pin_memory)
                view = data.numpy().data
                num_read = fh.readinto(view)
                trailing = fh.read(1)
        except OSError as exc:
            raise TierReadError(f"cannot read {path}: {exc}") from None
        if num_read != length or trailing:
            raise TierReadError(f"{path} holds {'more' if trailing else num_read} bytes, expected {length}")
        if checksum(view) != _HEADER.unpack(header)[4]:
            raise TierReadError(f"{path} fails its checksum")
        return data

    def _drop(self, slot: int, key: BlockHash) -> None:
        self.path(key).unlink(missing_ok=True)

    def _check_header(self, header: bytes, key: BlockHash) -> int:
        if len(header) != _HEADER.size:
            raise TierReadError("the file is shorter than its header")
        magic, fingerprint, file_key, length, _ = _HEADER.unpack(header)
        if magic != MAGIC:
            raise TierReadError("not a KV block file (bad magic)")
        if fingerprint != self.fingerprint:
            raise TierReadError("made by another model, backend, dtype or block size")
        if file_key != key:
            raise TierReadError("holds another block than its name says")
        return length
