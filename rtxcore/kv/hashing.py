"""Hash chains over full KV blocks, the keys of the automatic prefix cache.

A block's hash covers its parent's hash, its own token ids and an extra key (the request's cache salt), so equal
hashes mean equal content *and* equal history: attention states depend on every earlier token, not just the block's.

The values are persisted with the cache index, so they must not depend on the process: ``blake2b`` over a fixed,
length-delimited byte layout (little-endian int32 token ids), never Python's salted ``hash``. Changing the layout
is a format change: bump :data:`HASH_VERSION` so old indexes are not misread.
"""

from __future__ import annotations

import struct
from hashlib import blake2b
from typing import Sequence, TypeAlias

# 16-byte blake2b digest: small enough to keep per block, far beyond collision concerns for a cache index.
BlockHash: TypeAlias = bytes
HASH_SIZE = 16
HASH_VERSION = 1
_PERSON = b"rtx-kv-block-v%d" % HASH_VERSION  # blake2b personalisation: at most 16 bytes

# What besides the tokens separates cache entries (a cache salt today; adapter ids or media hashes later).
ExtraKey: TypeAlias = str | bytes | None


def hash_block(parent: BlockHash | None, token_ids: Sequence[int], extra_key: ExtraKey = None) -> BlockHash:
    """Hash one block given its parent's hash (``None`` for a request's first block).

    :raises ValueError: a token id outside int32, or a parent that is not a :data:`BlockHash`.
    """
    h = blake2b(digest_size=HASH_SIZE, person=_PERSON)
    # Every field is tagged or length-prefixed so two different inputs can never encode to the same bytes.
    if parent is None:
        h.update(b"\x00")
    else:
        if not isinstance(parent, bytes) or len(parent) != HASH_SIZE:
            raise ValueError(f"parent must be a {HASH_SIZE}-byte block hash, got {parent!r}")
        h.update(b"\x01")
        h.update(parent)
    h.update(_encode_extra_key(extra_key))
    try:
        h.update(struct.pack(f"<I{len(token_ids)}i", len(token_ids), *token_ids))
    except struct.error as exc:
        raise ValueError(f"token ids must be int32 integers: {exc}") from None
    return h.digest()


def hash_blocks(
    token_ids: Sequence[int],
    block_size: int,
    extra_key: ExtraKey = None,
    parent: BlockHash | None = None,
) -> list[BlockHash]:
    """Hashes of the full blocks of ``token_ids`` (a trailing partial block is skipped), chained from ``parent``.

    To extend a chain, pass the tokens after the last hashed block and that block's hash as ``parent``.
    """
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    hashes: list[BlockHash] = []
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = hash_block(parent, token_ids[start:start + block_size], extra_key)
        hashes.append(parent)
    return hashes


def _encode_extra_key(extra_key: ExtraKey) -> bytes:
    if extra_key is None:
        return b"\x00"
    if isinstance(extra_key, str):
        tag, data = b"\x01", extra_key.encode("utf-8")
    elif isinstance(extra_key, bytes):
        tag, data = b"\x02", extra_key
    else:
        raise ValueError(f"extra_key must be str, bytes or None, got {type(extra_key).__name__}")
    return tag + struct.pack("<I", len(data)) + data
