"""Warm restarts: the prefix cache written to the disk tier with an index, and read back at start.

:func:`copy_to_disk` copies every device and host block the disk tier lacks into it, and :func:`write_index` writes
``snapshot.json``
(atomically, fsynced): the cache fingerprint and layout it was made with, and the keys in the disk tier. At start,
:func:`load_snapshot` checks that index against this server's fingerprint before taking any block: an index from
another model, backend, dtype or block size, or one that does not parse, is ignored with a log line and its block
files are removed, never loaded. Blocks written after the last index (a crash) are taken too when their own
headers match; each block's checksum is checked again when it is read.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from hashlib import blake2b
from pathlib import Path

import torch

from rtxcore.files import replace_atomically
from rtxcore.kv.hashing import HASH_SIZE, HASH_VERSION, BlockHash
from rtxcore.kv.tiers.base import TierReadError
from rtxcore.kv.tiers.disk import FINGERPRINT_SIZE, SUFFIX, DiskTier
from rtxcore.kv.tiers.host import HostTier

log = logging.getLogger("rtx.kv")

INDEX_FILE = "snapshot.json"
FORMAT = 1
# Device blocks copied to the host per call while snapshotting: bounds the staging memory.
_READ_BATCH = 64


def cache_fingerprint(identity: dict) -> bytes:
    """What makes two servers' KV bytes interchangeable: weights, model shape, backend, dtype, block layout."""
    blob = json.dumps({**identity, "hash_version": HASH_VERSION}, sort_keys=True, default=str).encode()
    return blake2b(blob, digest_size=FINGERPRINT_SIZE).digest()


def copy_to_disk(disk: DiskTier, device_blocks: list[tuple[int, BlockHash]],
                 read_blocks: Callable[[list[int]], torch.Tensor], host: HostTier | None = None) -> int:
    """Write what the disk tier lacks, host blocks first, device blocks last (most recent, so kept longest); returns
    the number of blocks written. :func:`write_index` then makes them a snapshot."""
    written = 0
    with disk.storing_all():
        if host is not None:
            host.sync_for_host()
            for key in host.keys():
                if key not in disk:
                    try:
                        disk.store([key], host.peek(key).unsqueeze(0))
                    except TierReadError:
                        continue
                    written += key in disk
        missing = [(block_id, key) for block_id, key in device_blocks if key not in disk]
        for start in range(0, len(missing), _READ_BATCH):
            batch = missing[start:start + _READ_BATCH]
            disk.store([key for _, key in batch], read_blocks([block_id for block_id, _ in batch]))
            written += sum(key in disk for _, key in batch)
    return written


def write_index(disk: DiskTier, identity: dict) -> None:
    """The snapshot's index: what the disk tier holds and the cache layout it was made with (fsynced)."""
    index = {"format": FORMAT, "fingerprint": disk.fingerprint.hex(), "identity": identity,
             "block_bytes": disk.block_bytes, "created": time.time(), "keys": [k.hex() for k in disk.keys()]}
    replace_atomically(disk.root / INDEX_FILE, json.dumps(index).encode())


def load_snapshot(disk: DiskTier, identity: dict) -> int:
    """Take the blocks of a snapshot made by an identical server into the (empty) disk tier; returns how many."""
    path = disk.root / INDEX_FILE
    listed: list[BlockHash] = []
    if path.exists():
        problem, listed = _read_index(path, disk, identity)
        if problem is not None:
            log.warning("ignoring the KV cache snapshot in %s: %s; its blocks are removed", disk.root, problem)
            _remove_blocks(disk)
            path.unlink(missing_ok=True)
            return 0
    taken = sum(disk.adopt(key) for key in listed)
    # Files written after the index (a crash before the next snapshot): their headers vouch for them. What is not
    # taken (no room left, a foreign name, a crashed write's temporary file) is removed, so the directory stays
    # within the tier's size.
    for file in disk.files():
        try:
            key = bytes.fromhex(file.name.removesuffix(SUFFIX))
        except ValueError:
            key = b""
        if len(key) != HASH_SIZE or (key not in disk and not disk.adopt(key)):
            file.unlink(missing_ok=True)
    for tmp in disk.blocks_dir.glob("*/*.tmp*"):
        tmp.unlink(missing_ok=True)
    if taken:
        log.info("KV cache snapshot in %s: %d blocks ready to be reused", disk.root, taken)
    return taken


def _read_index(path: Path, disk: DiskTier, identity: dict) -> tuple[str | None, list[BlockHash]]:
    try:
        index = json.loads(path.read_bytes())
        fingerprint = bytes.fromhex(index["fingerprint"])
        keys = [bytes.fromhex(k) for k in index["keys"]]
        fmt, theirs = index["format"], index["identity"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        return f"its index {path.name} is damaged ({type(exc).__name__}: {exc})", []
    if fmt != FORMAT:
        return f"index format {fmt!r}, this server reads {FORMAT}", []
    if fingerprint != disk.fingerprint:
        differs = sorted(k for k in set(identity) | set(theirs or {}) if (theirs or {}).get(k) != identity.get(k))
        return f"it was made for another cache layout (differs in: {', '.join(differs) or 'fingerprint'})", []
    return None, keys


def _remove_blocks(disk: DiskTier) -> None:
    for file in disk.files():
        file.unlink(missing_ok=True)
