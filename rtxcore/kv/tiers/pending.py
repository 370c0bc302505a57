"""Device blocks whose bytes a GPU reload still has on the way, for the KV-cache manager.

A reload's blocks are registered in the prefix cache (and held by their request) at lookup, while their bytes travel
on a copy stream (:mod:`rtxcore.kv.tiers.offload`). Until :meth:`KVOffload.complete` has queued the move into them,
no step may read them: a reload keeps its request out of the steps until its bytes have arrived
(:meth:`PendingReloads.arrived`), and is then completed before the step that reads them is launched. Blocks given
up meanwhile (their request left, nobody else holds them) leave the prefix cache and are not written; a reload left
with no block is cancelled.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from rtxcore.kv.block_pool import BlockPool
from rtxcore.kv.tiers.offload import KVOffload, Reload


class PendingReloads:
    def __init__(self, offload: KVOffload, pool: BlockPool):
        self.offload = offload
        self.pool = pool
        self._reload_of: dict[int, Reload] = {}

    def __bool__(self) -> bool:
        return bool(self._reload_of)

    def __iter__(self) -> Iterator[int]:
        """The pending device blocks."""
        return iter(self._reload_of)

    def add(self, reload: Reload) -> None:
        """``reload``'s blocks (none once it is done: a CPU copies in place) wait for its bytes."""
        if not reload.done:
            for block_id in reload.block_ids:
                self._reload_of[block_id] = reload

    def arrived(self, block_ids: Iterable[int]) -> bool:
        """Whether no reload of these blocks is still copying; those that have arrived are completed."""
        for block_id in block_ids:
            reload = self._reload_of.get(block_id)
            if reload is not None:
                if not self.offload.arrived(reload):
                    return False
                self._complete(reload)
        return True

    def complete(self, block_ids: Iterable[int]) -> None:
        """Queue the bytes of every reload of these blocks into place, ahead of the step that reads them; then
        those of every reload that has arrived, freeing their staging memory."""
        for block_id in block_ids:
            reload = self._reload_of.get(block_id)
            if reload is not None:
                self._complete(reload)
        for reload in {id(r): r for r in self._reload_of.values()}.values():
            if self.offload.arrived(reload):
                self._complete(reload)

    def give_up(self, block_ids: Iterable[int]) -> None:
        """A request left holding these blocks: a pending one nobody else holds leaves the prefix cache (nothing
        valid is in it) and its reload no longer writes it; a reload left with no block is cancelled."""
        for block_id in block_ids:
            reload = self._reload_of.get(block_id)
            if reload is not None and self.pool.blocks[block_id].ref_cnt == 1:
                self.pool.uncache_unshared(block_id)
                del self._reload_of[block_id]
                if not any(self._reload_of.get(b) is reload for b in reload.block_ids):
                    self.offload.cancel(reload)

    def _complete(self, reload: Reload) -> None:
        keep = {b for b in reload.block_ids if self._reload_of.get(b) is reload}
        for block_id in keep:
            del self._reload_of[block_id]
        self.offload.complete(reload, keep)
