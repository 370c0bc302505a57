"""KV tiers on a GPU: copies between the device and the host tier run beside the steps, never waiting for them,
and the bytes arrive intact (skipped without a CUDA device)."""

from __future__ import annotations

import time

import pytest
import torch

from rtxcore import envs
from rtxcore.kv.tiers.disk import DiskTier
from rtxcore.kv.tiers.host import HostTier
from rtxcore.kv.tiers.offload import KVOffload
from tests.helpers.kv import POLICIES
from tests.kv.test_kv_tiers import BLOCK_BYTES, FINGERPRINT, key, payload


def gpu_offload(num_caches: int) -> tuple[list[torch.Tensor], list[torch.Tensor], KVOffload]:
    """Random bf16 caches on the GPU (block dimension 1, 8 blocks), copies of them, and a KVOffload over a pinned
    host tier of 8 blocks."""
    from rtxcore.kv.block_io import read_blocks, write_blocks

    caches = [torch.randn(2, 8, 4, 16, dtype=torch.bfloat16, device="cuda") for _ in range(num_caches)]
    block_bytes = sum(c[:, 0].numel() for c in caches) * 2
    host = HostTier(8, block_bytes, POLICIES["lru"](8), pin_memory=True)
    offload = KVOffload([host], lambda ids: read_blocks(caches, 1, ids),
                        lambda ids, data: write_blocks(caches, 1, ids, data), device="cuda")
    return caches, [c.clone() for c in caches], offload


def disk_offload(tmp_path) -> tuple[list[torch.Tensor], list[torch.Tensor], HostTier, DiskTier, KVOffload]:
    """Two random bf16 caches on the GPU with copies of them, a pinned host tier of 4 blocks over a disk tier of 8,
    and blocks 1, 3 and 5 on disk only, under keys 0-2 (zeroed on the device)."""
    from rtxcore.kv.block_io import read_blocks, write_blocks

    caches = [torch.randn(2, 8, 4, 16, dtype=torch.bfloat16, device="cuda") for _ in range(2)]
    expected = [c.clone() for c in caches]
    block_bytes = sum(c[:, 0].numel() for c in caches) * 2
    disk = DiskTier(tmp_path, 8, block_bytes, POLICIES["lru"](8), FINGERPRINT)
    host = HostTier(4, block_bytes, POLICIES["lru"](4), below=disk, pin_memory=True)
    offload = KVOffload([host, disk], lambda ids: read_blocks(caches, 1, ids),
                        lambda ids, data: write_blocks(caches, 1, ids, data), device="cuda")
    disk.store([key(n) for n in range(3)], read_blocks(caches, 1, [1, 3, 5]))
    for c in caches:
        c[:, 1:6:2] = 0
    return caches, expected, host, disk, offload


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device: the check is that nothing waits for it")
def test_spill_and_reload_on_a_gpu_never_wait_for_it():
    """Offload runs on the engine's thread between steps: a copy that waits for the device (a blocking copy from
    pageable memory, an index list turned into a device tensor) stalls the step in flight. CUDA's sync debug mode
    raises on any such wait; the bytes must still arrive intact."""
    caches, expected, offload = gpu_offload(4)
    keys = [key(n) for n in range(3)]
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        offload.spill(list(zip([1, 3, 5], keys)))
        for c in caches:
            c[:, 1:6:2] = 0  # the device reuses the blocks
        tiers = offload.pin_run(keys)
        reload = offload.reload(keys, tiers, [6, 7, 2])
        assert reload.num_loaded == 3
        offload.complete(reload)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    for c, e in zip(caches, expected):
        assert torch.equal(c[:, [6, 7, 2]], e[:, [1, 3, 5]])


# About half a second of GPU time: long enough that a host that waited for it shows.
_GPU_SLEEP_CYCLES = 10**9


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device: the check is that nothing waits for it")
def test_reload_from_disk_on_a_gpu_never_waits_for_it(tmp_path):
    """Blocks read back from disk are in pageable memory, and an asynchronous copy from pageable memory still waits
    for the stream (which sync debug mode does not report): they are staged in pinned memory first. With a long
    kernel queued, the stream must still be busy when reload returns. The blocks also go to the host tier above."""
    caches, expected, host, disk, offload = disk_offload(tmp_path)
    keys = [key(n) for n in range(3)]
    torch.cuda.synchronize()
    tiers = offload.pin_run(keys)
    assert tiers == [disk, disk, disk]
    torch.cuda._sleep(_GPU_SLEEP_CYCLES)
    reload = offload.reload(keys, tiers, [6, 7, 2])
    assert reload.num_loaded == 3
    offload.complete(reload)
    assert not torch.cuda.current_stream().query(), "reload waited for the GPU"
    torch.cuda.synchronize()
    for c, e in zip(caches, expected):
        assert torch.equal(c[:, [6, 7, 2]], e[:, [1, 3, 5]])
    assert all(k in host for k in keys)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device: the check is a copy beside a kernel")
def test_a_reload_copies_beside_the_step_in_flight():
    """The bytes of a reload travel while a step (a long kernel here) runs: they arrive before it ends, and go into
    their blocks after it, intact. A block spilled behind that step and reloaded at once waits for its own copy
    out, and for nothing else."""
    caches, expected, offload = gpu_offload(2)
    keys = [key(n) for n in range(3)]
    offload.spill(list(zip([1, 3, 5], keys)))
    torch.cuda.synchronize()
    for c in caches:
        c[:, 1:6:2] = 0
    torch.cuda._sleep(_GPU_SLEEP_CYCLES)  # the step in flight
    reload = offload.reload(keys, offload.pin_run(keys), [6, 7, 2])
    deadline = time.monotonic() + 5
    while not offload.arrived(reload) and time.monotonic() < deadline:
        time.sleep(0.001)
    assert offload.arrived(reload) and not torch.cuda.current_stream().query(), "the copy waited for the step"
    offload.complete(reload)
    torch.cuda.synchronize()
    for c, e in zip(caches, expected):
        assert torch.equal(c[:, [6, 7, 2]], e[:, [1, 3, 5]])
    offload.end_step()
    assert offload.stats.num_copy_wait_steps == 0

    # Spilled behind a step and reloaded at once: the copy back waits for the copy out, and its bytes are right.
    torch.cuda._sleep(_GPU_SLEEP_CYCLES)
    offload.spill([(4, key(9))])
    reload = offload.reload([key(9)], offload.pin_run([key(9)]), [0])
    assert not offload.arrived(reload), "the copy back overtook the copy out"
    offload.complete(reload)
    torch.cuda.synchronize()
    for c in caches:
        assert torch.equal(c[:, 0], c[:, 4])


def stored_behind_the_gpu(tmp_path, host_slots: int, num_blocks: int) -> tuple[HostTier, DiskTier, torch.Tensor]:
    """A pinned host tier over a disk tier of 8 blocks, and keys 1..num_blocks stored into it from the device while
    the GPU is busy: the copies into the host buffer queue behind a long kernel. Returns the device's blocks too."""
    block_bytes = 1 << 16
    disk = DiskTier(tmp_path, 8, block_bytes, POLICIES["lru"](8), FINGERPRINT)
    host = HostTier(host_slots, block_bytes, POLICIES["lru"](host_slots), below=disk, pin_memory=True)
    data = torch.stack([payload(n).repeat(block_bytes // BLOCK_BYTES) for n in range(1, num_blocks + 1)]).cuda()
    torch.cuda.synchronize()
    torch.cuda._sleep(_GPU_SLEEP_CYCLES)
    host.store([key(n) for n in range(1, num_blocks + 1)], data)
    return host, disk, data


@pytest.mark.skipif(not torch.cuda.is_available(),
                    reason="needs a CUDA device: copies to the host tier are asynchronous")
def test_a_block_evicted_by_its_own_store_reaches_disk_intact(tmp_path):
    """One store larger than the host tier evicts slots it wrote earlier in the same call: their copies from the
    device must have landed before they are read for the disk tier."""
    host, disk, data = stored_behind_the_gpu(tmp_path, host_slots=2, num_blocks=4)
    torch.cuda.synchronize()
    for n in (1, 2):
        assert torch.equal(disk.load(key(n)), data[n - 1].cpu()), f"block {n} reached disk before its bytes"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device: the copy into the host is queued")
def test_a_block_written_through_to_disk_waits_for_its_bytes(tmp_path):
    """The host tier lends a block to the disk tier's writer as soon as its copy from the device is queued: the
    writer (and a read served from the lent row meanwhile) must wait for that copy to land, however late it runs."""
    host, disk, data = stored_behind_the_gpu(tmp_path, host_slots=4, num_blocks=3)
    assert all(key(n) in disk for n in range(1, 4)), "written through at the store"
    assert disk.pin(key(1)) and torch.equal(disk.load(key(1)), data[0].cpu()), "a read before its bytes landed"
    disk.unpin(key(1))
    disk.flush()
    for n in (2, 3):
        assert disk.pin(key(n)) and torch.equal(disk.reader(key(n), False)(), data[n - 1].cpu())
        disk.unpin(key(n))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device: the copy reads pinned host memory")
def test_pinned_rows_outlive_the_copy_that_reads_them(tmp_path):
    """Rows read from disk are staged in pinned memory that only the reload refers to. The copy reads them by
    address once the step in flight ends, after reload has returned: memory torch's pinned cache handed out again
    meanwhile, and filled, must not be what arrives."""
    caches, expected, host, disk, offload = disk_offload(tmp_path)
    assert offload._row_copier.available or not envs.RTX_KV_ROW_COPY.get(), "Triton and a GPU: one launch"
    keys = [key(n) for n in range(3)]
    torch.cuda.synchronize()
    # The copy stream itself is busy, so the copy surely runs after the garbage below is written.
    offload._copy_stream = torch.cuda.Stream()
    with torch.cuda.stream(offload._copy_stream):
        torch.cuda._sleep(_GPU_SLEEP_CYCLES)
    reload = offload.reload(keys, offload.pin_run(keys), [6, 7, 2])
    assert not offload.arrived(reload)
    for _ in range(8):  # whatever pinned blocks of that size are free now get garbage
        torch.empty((3, host.block_bytes), dtype=torch.uint8, pin_memory=True).fill_(0xAB)
    offload.complete(reload)
    torch.cuda.synchronize()
    for c, e in zip(caches, expected):
        assert torch.equal(c[:, [6, 7, 2]], e[:, [1, 3, 5]])
