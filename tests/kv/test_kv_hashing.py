"""Block hashing for the prefix cache: pinned values, stable across processes, chained and salted."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from rtxcore.kv.hashing import hash_block, hash_blocks

# ---- hashing ----------------------------------------------------------------------------------------------------


def test_block_hash_is_pinned():
    # Persisted indexes depend on these exact values: a change here needs a HASH_VERSION bump.
    first = hash_block(None, [1, 2, 3, 4])
    assert first.hex() == "19421cb88bc8094210a7602153406384"
    assert hash_block(first, [5, 6, 7, 8], "salt").hex() == "0d23bb9eef584bfbb9036b7bc68b01ef"


def test_block_hash_is_stable_across_processes():
    code = "from rtxcore.kv.hashing import hash_blocks; print(hash_blocks(list(range(20)), 4, 'x')[-1].hex())"
    outputs = {
        subprocess.run([sys.executable, "-c", code], env={**os.environ, "PYTHONHASHSEED": seed},
                       capture_output=True, text=True, check=True).stdout.strip()
        for seed in ("1", "2")
    }
    assert outputs == {hash_blocks(list(range(20)), 4, "x")[-1].hex()}


def test_block_hash_separates_parent_tokens_and_extra_key():
    parent = hash_block(None, [9])
    variants = {
        hash_block(None, [1, 2]),
        hash_block(parent, [1, 2]),
        hash_block(None, [2, 1]),
        hash_block(None, [1, 2], "a"),
        hash_block(None, [1, 2], b"a"),
        hash_block(None, [1, 2], ""),
    }
    assert len(variants) == 6
    with pytest.raises(ValueError):
        hash_block(None, [2**31])


def test_hash_blocks_skips_partial_block_and_extends():
    tokens = list(range(11))
    full = hash_blocks(tokens, 4)
    assert len(full) == 2
    assert hash_blocks(tokens[4:], 4, parent=full[0]) == full[1:]


# ---- manager ------------------------------------------------------------------------------------------------------
