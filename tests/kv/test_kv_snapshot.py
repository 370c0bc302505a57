"""The engine with KV tiers: same tokens as without, warm restarts from the disk tier, and snapshots that do not
match (another block size, a damaged index or block) ignored with a log line."""

from __future__ import annotations

import json
import logging
import random

import pytest

from rtxcore.contracts.scheduler import SchedulerConfig
from rtxcore.engine.config import EngineConfig
from rtxcore.engine.llm import LLM
from rtxcore.errors import ConfigError
from rtxcore.kv.tiers.snapshot import INDEX_FILE
from rtxcore.sampling_params import SamplingParams

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


def engine(num_blocks=24, block_size=16, **tiers) -> LLM:
    return LLM(EngineConfig(model="dummy:tiny", num_kv_blocks=num_blocks, block_size=block_size,
                                  max_model_len=512, scheduling=SchedulerConfig(max_num_seqs=2), **tiers))


def conversations(n=5, length=70, seed=0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 200) for _ in range(length)] for _ in range(n)]


def run(e: LLM, prompts) -> tuple[list[list[int]], int, int]:
    """Generate for each prompt; returns the tokens, prompt tokens and cached prompt tokens."""
    results = e.generate(prompts, GREEDY)
    return ([r.token_ids for r in results], sum(len(r.prompt_token_ids) for r in results),
            sum(r.num_cached_tokens for r in results))


def two_rounds(e: LLM, prompts) -> tuple[list[list[int]], float]:
    """Every prompt, then every prompt extended by its reply: the second round's cached share."""
    first, _, _ = run(e, prompts)
    tokens, total, cached = run(e, [p + t + [5, 6, 7] for p, t in zip(prompts, first)])
    return first + tokens, cached / total


def test_offload_keeps_tokens_and_recovers_hits(tmp_path):
    prompts = conversations()
    plain_tokens, plain_rate = two_rounds(engine(), prompts)
    host_tokens, host_rate = two_rounds(engine(kv_host_bytes=4 << 20), prompts)
    e = engine(kv_host_bytes=64 << 10, kv_disk_dir=str(tmp_path))
    disk_tokens, disk_rate = two_rounds(e, prompts)
    assert plain_tokens == host_tokens == disk_tokens
    # The device holds few of the conversations (on a CPU 0.19 of the second round's prompt tokens hit it, on the H200
    # 0.30, where steps overlap and blocks free in another order); the tiers hold them all.
    assert plain_rate < 0.4 and host_rate > 0.8 and disk_rate > 0.8
    assert e.core.kv_cache.stats.num_reloaded_tokens > 0 and len(e.core.kv_tiers.disk) > 0
    e.core.kv_cache.check_invariants()
    for tier in e.core.kv_tiers.tiers:
        tier.check_invariants()


def test_a_restart_starts_warm_from_the_snapshot(tmp_path):
    prompts = conversations()
    first = engine(kv_disk_dir=str(tmp_path))
    tokens, _, _ = run(first, prompts)
    assert first.core.save_kv_snapshot() > 0 and (tmp_path / INDEX_FILE).exists()
    del first
    second = engine(kv_disk_dir=str(tmp_path))
    again, total, cached = run(second, prompts)
    assert again == tokens
    # Every full block of every prompt comes back from disk: only the last partial block is computed.
    assert cached == sum(len(p) // 16 * 16 for p in prompts) and cached / total > 0.85


def test_a_snapshot_for_another_block_size_is_ignored(tmp_path, caplog):
    first = engine(kv_disk_dir=str(tmp_path))
    run(first, conversations())
    first.core.save_kv_snapshot()
    with caplog.at_level(logging.WARNING, logger="rtx.kv"):
        other = engine(num_blocks=12, block_size=32, kv_disk_dir=str(tmp_path))
    assert "ignoring the KV cache snapshot" in caplog.text and "block_size" in caplog.text
    assert len(other.core.kv_tiers.disk) == 0 and not any(tmp_path.glob("blocks/*/*.kvb"))
    _, _, cached = run(other, conversations())
    assert cached == 0


def test_a_damaged_index_is_ignored(tmp_path, caplog):
    first = engine(kv_disk_dir=str(tmp_path))
    run(first, conversations())
    first.core.save_kv_snapshot()
    (tmp_path / INDEX_FILE).write_text(json.dumps({"format": 1, "fingerprint": "zz"}))
    with caplog.at_level(logging.WARNING, logger="rtx.kv"):
        again = engine(kv_disk_dir=str(tmp_path))
    assert "index snapshot.json is damaged" in caplog.text and len(again.core.kv_tiers.disk) == 0


def test_a_damaged_block_is_recomputed_not_loaded(tmp_path, caplog):
    prompts = conversations(n=1)
    first = engine(kv_disk_dir=str(tmp_path))
    tokens, _, _ = run(first, prompts)
    first.core.save_kv_snapshot()
    damaged = {}
    for path in sorted(tmp_path.glob("blocks/*/*.kvb")):  # flip one byte of every block's KV
        raw = bytearray(path.read_bytes())
        raw[-3] ^= 0x40
        damaged[path] = bytes(raw)
        path.write_bytes(damaged[path])
    second = engine(kv_disk_dir=str(tmp_path))
    with caplog.at_level(logging.WARNING, logger="rtx.kv"):
        again, _, cached = run(second, prompts)
    second.core.kv_tiers.disk.flush()  # every write asked for has landed
    assert again == tokens and cached == 0
    # The request's disk blocks are read together: each one found damaged is dropped, its file removed. A block
    # recomputed and spilled again may be written back under the same name, now intact.
    dropped = [path for path, raw in damaged.items() if not path.exists() or path.read_bytes() != raw]
    assert "damaged" in caplog.text and second.core.kv_tiers.disk.stats.num_corrupt == len(dropped) >= 1


def test_offload_settings_are_checked():
    with pytest.raises(ConfigError, match="prefix caching"):
        EngineConfig(model="dummy:tiny", kv_host_bytes=1 << 20, enable_prefix_caching=False)
    with pytest.raises(ConfigError, match="hold no block"):
        engine(kv_host_bytes=10)
