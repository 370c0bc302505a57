"""The KV-cache manager: which blocks each request holds, and the automatic prefix cache.

It implements :class:`rtxcore.contracts.scheduler.KVCacheAllocator`, so the scheduler only ever sees ``True`` /
``False`` and token counts; block ids go to the backend through :meth:`KVCacheManager.block_ids`.

Blocks are registered in the prefix cache as soon as :meth:`~KVCacheManager.allocate` makes them full of known
tokens, before the step that computes them runs. That is safe because a request that hits them is scheduled in the
same step or later, and a forward pass writes a layer's KV before any attention of that layer reads it.

Blocks reloaded from a lower tier on a GPU are registered at lookup too, while their bytes are still on the way
(:mod:`rtxcore.kv.tiers.offload`, :mod:`rtxcore.kv.tiers.pending`): a request holding one is not
:meth:`~KVCacheManager.ready`, and :meth:`~KVCacheManager.prepare_step` puts the bytes in place before any step that
reads them.

Blocks only the disk holds are not part of the lookup's hit: the lookup starts reading them on worker threads, the
request is not ready until they are in, and :meth:`~KVCacheManager.ready` then extends its hit with them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from rtxcore.contracts.eviction import EvictionPolicy
from rtxcore.errors import ConfigError
from rtxcore.kv.block_pool import BlockPool, BlockPoolError
from rtxcore.kv.block_table import BlockTable
from rtxcore.kv.hashing import BlockHash, hash_blocks
from rtxcore.kv.tiers.evict_ahead import EvictAhead
from rtxcore.kv.tiers.host import HostTier
from rtxcore.kv.tiers.offload import KVOffload
from rtxcore.kv.tiers.pending import PendingReloads
from rtxcore.kv.tiers.prefetch import Prefetch
from rtxcore.kv.tiers.write_back import WriteBack
from rtxcore.request import Request


@dataclass(slots=True)
class KVCacheStats:
    # Requests looked up in the prefix cache (a preempted request counts again when it is looked up again).
    num_prefix_queries: int = 0
    # Tokens those lookups asked for (each request's full length at lookup time).
    num_prefix_query_tokens: int = 0
    # Of those, tokens found in the cache.
    num_prefix_hit_tokens: int = 0
    # Cached blocks reclaimed to make room.
    num_evictions: int = 0
    # Of the hit tokens, those whose blocks came back from a lower tier (host memory or disk).
    num_reloaded_tokens: int = 0

    @property
    def prefix_hit_rate(self) -> float:
        return self.num_prefix_hit_tokens / self.num_prefix_query_tokens if self.num_prefix_query_tokens else 0.0


@dataclass(slots=True)
class _RequestBlocks:
    # The request's row in the manager's BlockTable, which mirrors block_ids.
    row: int = BlockTable.EMPTY_ROW
    # The request's blocks in token order: block i holds tokens [i * block_size, (i + 1) * block_size).
    block_ids: list[int] = field(default_factory=list)
    # Hashes of the request's full blocks computed so far, extended as tokens arrive; never recomputed.
    block_hashes: list[BlockHash] = field(default_factory=list)
    # Leading blocks already registered in (or found in) the prefix cache.
    num_cached_blocks: int = 0
    # Tokens covered by lookup_prefix's hits: shared KV the request must never write again.
    num_hit_tokens: int = 0
    # True once allocate() ran: a second lookup_prefix would then discard computed KV.
    allocated: bool = False
    # Tokens the last allocate() made room for (for the fragmentation metric; the blocks may cover more).
    num_tokens: int = 0
    # The disk blocks that follow the hit, being read: ready() extends the hit with them once they are in.
    prefetch: Prefetch | None = None


# How long an engine with nothing to schedule waits before asking again while requests wait for lower tiers' copies
# or reads (milliseconds each), instead of spinning on empty schedules and taking the GIL from the reading threads.
COPY_POLL_S = 0.001

# What block_table() reads for a request that holds nothing; never stored or changed.
_NO_BLOCKS = _RequestBlocks()


class KVCacheManager:
    """Paged KV bookkeeping over a :class:`BlockPool` of ``num_blocks`` blocks (block 0 reserved as null block)."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        eviction_policy: EvictionPolicy,
        enable_prefix_caching: bool = True,
        offload: KVOffload | None = None,
        write_back: bool | None = None,
        evict_ahead: bool | None = None,
    ):
        if block_size < 1:
            raise ConfigError(f"block_size must be >= 1, got {block_size}")
        self.pool = BlockPool(num_blocks, eviction_policy)
        self._block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._requests: dict[str, _RequestBlocks] = {}
        self._table = BlockTable()
        self._stats = KVCacheStats()
        # Lower tiers (host memory, disk) that evicted prefix-cache blocks go to, and come back from.
        self.offload = offload
        if offload is not None:
            if not enable_prefix_caching:
                raise ConfigError("KV offload keeps prefix-cache blocks: it needs prefix caching on")
            self.pool.on_evict = self._spill
        # Computed blocks copied down ahead of their eviction, and blocks evicted in batches ahead of the
        # allocations that need them: by default on a GPU over a host tier.
        on_gpu_over_host = offload is not None and offload.device.type == "cuda" and isinstance(offload.top, HostTier)
        if write_back is None:
            write_back = on_gpu_over_host
        if evict_ahead is None:
            evict_ahead = on_gpu_over_host
        self.write_back = WriteBack(offload, self.pool) if offload is not None and write_back else None
        self.evict_ahead = EvictAhead(self.pool) if offload is not None and evict_ahead else None
        # Device blocks whose bytes a reload still has on the way (GPU only).
        self._pending = PendingReloads(offload, self.pool) if offload is not None else None

    @property
    def block_size(self) -> int:
        return self._block_size

    @property
    def num_blocks(self) -> int:
        """Blocks in the pool, the reserved null block included: the size the backend allocates."""
        return self.pool.num_blocks

    @property
    def num_usable_blocks(self) -> int:
        """Blocks requests can hold: the most a single request can ever get."""
        return self.pool.num_usable_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def usage(self) -> float:
        return self.pool.usage

    @property
    def fragmentation(self) -> float:
        """Fraction of the slots in blocks held by requests that hold no token (the unfilled tails of their last
        blocks); 0.0 when nothing is held. A block shared by several requests counts once per holder."""
        num_slots = num_filled = 0
        for state in self._requests.values():
            slots = len(state.block_ids) * self._block_size
            num_slots += slots
            num_filled += min(slots, max(state.num_tokens, state.num_hit_tokens))
        return (num_slots - num_filled) / num_slots if num_slots else 0.0

    @property
    def num_cached_blocks(self) -> int:
        """Blocks registered in the prefix cache, in use or evictable."""
        return self.pool.num_cached_blocks

    @property
    def stats(self) -> KVCacheStats:
        """A snapshot of the counters since start-up."""
        s = self._stats
        return KVCacheStats(s.num_prefix_queries, s.num_prefix_query_tokens, s.num_prefix_hit_tokens,
                            self.pool.num_evictions, s.num_reloaded_tokens)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self._block_size)

    def block_ids(self, req_id: str) -> list[int]:
        """The request's block table (a copy); empty for a request holding nothing."""
        state = self._requests.get(req_id)
        return list(state.block_ids) if state is not None else []

    def block_table(self, req_ids: Sequence[str]) -> np.ndarray:
        """The requests' block tables as one new int32 array [len(req_ids), most blocks any of them holds], each row
        padded with 0 (the null block) past its last block; a request holding nothing gets a row of padding."""
        return self._table.gather([self._requests.get(req_id, _NO_BLOCKS).row for req_id in req_ids])

    def lookup_prefix(self, req: Request) -> int:
        """Hold the longest cached chain of full blocks matching ``req``'s tokens; returns the tokens they cover.

        At least one token is always left to compute, so the model still produces logits for the request.

        :raises BlockPoolError: the request already allocated since its last :meth:`free`.
        """
        state = self._requests.get(req.req_id)
        if state is not None and state.prefetch is not None and not state.allocated:
            # Asked again while its disk reads are in flight (its hit may be 0, which a scheduler takes for "not
            # looked up yet"): the reads and the hold stay, and ready() says when they are in.
            return state.num_hit_tokens
        if state is not None:
            if state.allocated:
                raise BlockPoolError(f"lookup_prefix({req.req_id!r}) after allocate(); free() the request first")
            # A repeated lookup (the scheduler retrying admission) replaces the previous hold.
            self.free(req)
        if not self.enable_prefix_caching:
            return 0
        state = self._add_state(req.req_id)
        # Known tokens only: a pending token's value is not on the host yet.
        num_known = len(req.all_token_ids)
        self._extend_hashes(req, state, num_known)

        self._find_hit(state, (num_known - 1) // self._block_size)
        self._stats.num_prefix_queries += 1
        self._stats.num_prefix_query_tokens += num_known
        return state.num_hit_tokens

    def _find_hit(self, state: _RequestBlocks, max_hit_blocks: int,
                  fetched: dict[BlockHash, torch.Tensor] | None = None, fetched_at: float | None = None) -> None:
        """Extend the request's hit with the cached blocks that follow it, on the device or in a lower tier; with
        ``fetched``, the bytes a prefetch started at ``fetched_at`` read (a run going on past them is read next)."""
        start = len(state.block_ids)
        for block_hash in state.block_hashes[start:max_hit_blocks]:
            block_id = self.pool.lookup(block_hash)
            if block_id is None:
                break
            self.pool.incref(block_id)
            state.block_ids.append(block_id)
        if self.offload is not None and len(state.block_ids) < max_hit_blocks:
            self._reload(self.offload, state, max_hit_blocks, fetched, fetched_at)
        self._table.append(state.row, start, state.block_ids[start:])
        state.num_cached_blocks = len(state.block_ids)
        self._stats.num_prefix_hit_tokens += len(state.block_ids) * self._block_size - state.num_hit_tokens
        state.num_hit_tokens = len(state.block_ids) * self._block_size

    def ready(self, req: Request) -> bool:
        """Whether ``req`` may join the next step: False while its lookup's disk reads are still running, or a
        reload from a lower tier is still copying (a scheduler then lets requests behind it go first; the lookup's
        hold stays), so that no step waits for a copy. When the disk reads are in, the hit grows by the blocks they
        brought: True then comes with ``req.num_computed_tokens`` raised to the new hit."""
        state = self._requests.get(req.req_id)
        if state is None:
            return True
        if state.prefetch is not None:
            if not state.prefetch.done():
                return False
            self._extend_hit(req, state, state.prefetch)
            if state.prefetch is not None:  # the run goes on on disk past the reads that were in flight: read on
                return False
        return not self._pending or self._pending.arrived(state.block_ids)

    def _extend_hit(self, req: Request, state: _RequestBlocks, fetch: Prefetch) -> None:
        state.prefetch = None
        if req.num_computed_tokens != state.num_hit_tokens or state.allocated:
            self._drop_prefetch(fetch)  # not placed as its lookup left it: its hit cannot change now
            return
        assert self.offload is not None, "only a lookup with tiers prefetches"
        self._find_hit(state, (len(req.all_token_ids) - 1) // self._block_size, self.offload.collect(fetch),
                       fetch.started_s)
        req.num_computed_tokens = state.num_hit_tokens

    def _drop_prefetch(self, fetch: Prefetch) -> None:
        assert self.offload is not None, "only a lookup with tiers prefetches"
        self.offload.drop_prefetch(fetch)

    def idle_step(self) -> float:
        """Nothing was scheduled: collect what lower tiers finished, and say how long to wait before scheduling
        again (0.0 unless a request waits for a copy or a read, which a step of nothing cannot speed up)."""
        if self.offload is None:
            return 0.0
        self.offload.end_step()
        waiting = self._pending or any(state.prefetch is not None for state in self._requests.values())
        return COPY_POLL_S if waiting else 0.0

    def prepare_step(self, reqs: Sequence[Request]) -> None:
        """Before a step of ``reqs`` is launched: the bytes of every reload they hold go into their blocks, ahead
        of the step on the device's stream (which waits there for what is left of a copy only when a scheduler placed a
        request without asking :meth:`ready`); reloads that have arrived for others too, freeing their
        staging memory."""
        if self.offload is not None:
            if self._pending:
                self._pending.complete(block_id for req in reqs
                                       for block_id in self._requests.get(req.req_id, _NO_BLOCKS).block_ids)
            if self.write_back is not None:
                self.write_back.before_launch()
            if self.evict_ahead is not None:
                self.evict_ahead.before_launch()
            self.offload.end_step()

    def allocate(self, req: Request, num_new_tokens: int) -> bool:
        """Make ``req``'s blocks cover ``req.num_computed_tokens + num_new_tokens`` tokens; all or nothing.

        Blocks that thereby become full of known tokens are registered in the prefix cache under their chained
        hash; a block whose hash is already cached elsewhere stays private (the existing entry is kept).
        """
        if num_new_tokens < 0:
            raise ValueError(f"num_new_tokens must be >= 0, got {num_new_tokens}")
        state = self._requests.get(req.req_id)
        if state is None:
            state = self._add_state(req.req_id)
        elif req.num_computed_tokens < state.num_hit_tokens:
            # The backend would write from num_computed_tokens on, i.e. into cached blocks other requests share.
            raise BlockPoolError(
                f"request {req.req_id!r} has num_computed_tokens={req.num_computed_tokens} below the "
                f"{state.num_hit_tokens} tokens lookup_prefix found; set it to lookup_prefix's result"
            )
        num_tokens = req.num_computed_tokens + num_new_tokens
        block_size = self._block_size
        num_missing = -(-num_tokens // block_size) - len(state.block_ids)
        if num_missing > 0:
            new_block_ids = self.pool.allocate(num_missing)
            if new_block_ids is None:
                if not state.block_ids:
                    self._drop_state(req.req_id)  # leave no trace of a request that got nothing
                return False
            self._table.append(state.row, len(state.block_ids), new_block_ids)
            state.block_ids.extend(new_block_ids)
        state.allocated = True
        state.num_tokens = num_tokens
        if state.prefetch is not None:  # placed without asking ready(): it computes what the reads would bring
            self._drop_prefetch(state.prefetch)
            state.prefetch = None

        # Usually false (a decode fills a block only once every block_size steps), so cheap to test first.
        if self.enable_prefix_caching and num_tokens // block_size > state.num_cached_blocks:
            # Full of known tokens: a block ending in a pending token is hashed on a later call.
            num_full_blocks = min(num_tokens, len(req.all_token_ids)) // block_size
            if num_full_blocks > state.num_cached_blocks:
                self._extend_hashes(req, state, num_full_blocks * block_size)
                write_back = self.write_back
                for i in range(state.num_cached_blocks, num_full_blocks):
                    block_id, key = state.block_ids[i], state.block_hashes[i]
                    if self.pool.cache_block(block_id, key) == block_id and write_back is not None:
                        write_back.cached(block_id, key)
                state.num_cached_blocks = num_full_blocks
        return True

    def free(self, req: Request) -> None:
        """Release every block ``req`` holds; does nothing for a request holding none."""
        if req.req_id in self._requests:
            state = self._drop_state(req.req_id)
            if self._pending:
                self._pending.give_up(state.block_ids)
            # Blocks registered for KV the request never got to compute (taken back in the step that scheduled
            # it) must not stay cached: a later hit, or a copy in a lower tier, would hold garbage.
            num_valid = max(req.num_computed_tokens, state.num_hit_tokens) // self._block_size
            for block_id in state.block_ids[num_valid:state.num_cached_blocks]:
                self.pool.uncache_unshared(block_id)
                if self.write_back is not None:
                    self.write_back.forget(block_id)
            # Tail first: under LRU a chain's tail is then evicted before its head, which later requests need most.
            self.pool.free_blocks(reversed(state.block_ids))

    def reset_prefix_cache(self) -> int:
        """Drop every cached hash (e.g. after a weight update), in the lower tiers too; returns the number of device
        blocks that left the cache."""
        if self.offload is not None:
            # Reads started before the reset must not bring their bytes back: nobody uses or promotes them.
            for state in self._requests.values():
                if state.prefetch is not None:
                    self.offload.drop_prefetch(state.prefetch, promote=False)
                    state.prefetch = None
            self.offload.forget_reads()
            for tier in self.offload.tiers:
                tier.clear()
            if self.write_back is not None:
                self.write_back.clear()
        return self.pool.reset_prefix_cache()

    def check_invariants(self) -> None:
        """Check the pool plus the manager's per-request tables; for tests and debugging."""
        self.pool.check_invariants()
        num_refs = [0] * self.pool.num_blocks
        for req_id, state in self._requests.items():
            if len(set(state.block_ids)) != len(state.block_ids):
                raise BlockPoolError(f"request {req_id!r} holds a block twice")
            for block_id in state.block_ids:
                num_refs[block_id] += 1
        self._table.check_invariants({state.row: state.block_ids for state in self._requests.values()})
        for block_id in self._pending or ():
            if num_refs[block_id] == 0:
                raise BlockPoolError(f"block {block_id} awaits a reload's bytes but nobody holds it")
        for block in self.pool.blocks:
            if block.ref_cnt != num_refs[block.block_id]:
                raise BlockPoolError(
                    f"block {block.block_id} has ref_cnt {block.ref_cnt} but {num_refs[block.block_id]} holders"
                )

    def _reload(self, offload: KVOffload, state: _RequestBlocks, max_hit_blocks: int,
                fetched: dict[BlockHash, torch.Tensor] | None, fetched_at: float | None) -> None:
        """Extend the request's hit with blocks a lower tier holds, copied into fresh device blocks from now on, so
        they are in place before the request's first step (prefetch at admission; on a GPU the copy runs while
        steps do, and the blocks stay pending until it has arrived). The run stops at the first block only a slow
        tier (disk) holds and ``fetched`` lacks: from there on, the blocks are read on worker threads
        (state.prefetch), and ready() extends the hit with them once they are in."""
        keys = state.block_hashes[len(state.block_ids):max_hit_blocks]
        tiers = offload.pin_run(keys)
        slow = next((i for i, (key, tier) in enumerate(zip(keys, tiers))
                     if tier.reads_in_background and not (fetched and key in fetched)), len(tiers))
        if slow < len(tiers):
            # No more than the device could take now (the rest is computed): reads beyond it would be dropped.
            num_read = max(0, self.pool.num_free_blocks - slow)
            if num_read:
                fetch = offload.prefetch(keys[slow:slow + num_read], tiers[slow:slow + num_read])
                if fetch.keys or fetch.cut:  # cut with nothing read: reads in flight fill the cap; wait for them
                    state.prefetch = fetch
            # A block not read (past the cap, or the prefetch could not read it) is computed.
            for key, tier in zip(keys[slow + num_read:], tiers[slow + num_read:]):
                tier.unpin(key)
            tiers = tiers[:slow]
        # Only what fits without taking blocks from requests: cached idle blocks may be evicted (and spilled) for it.
        n = min(len(tiers), self.pool.num_free_blocks)
        block_ids = self.pool.allocate(n) if n else []
        # allocate() answers None only when asked for more than num_free_blocks, and n is capped at that.
        assert block_ids is not None
        reload = offload.reload(keys[:len(tiers)], tiers, block_ids, fetched, fetched_at)
        num_loaded = reload.num_loaded
        for block_id, key in zip(block_ids[:num_loaded], keys):
            self.pool.cache_block(block_id, key)
        assert self._pending is not None, "made with the offload"
        self._pending.add(reload)
        self.pool.free_blocks(block_ids[num_loaded:])
        state.block_ids.extend(block_ids[:num_loaded])
        self._stats.num_reloaded_tokens += num_loaded * self._block_size

    def _spill(self, victims: list[tuple[int, BlockHash]]) -> None:
        """The pool is reusing these cached blocks (BlockPool.on_evict)."""
        assert self.offload is not None
        if self.write_back is not None:
            for block_id, _ in victims:
                self.write_back.forget(block_id)
        self.offload.spill(victims)

    def cached_blocks(self) -> list[tuple[int, BlockHash]]:
        """The (block id, hash) of every block in the device's prefix cache."""
        return self.pool.cached_blocks()

    def _add_state(self, req_id: str) -> _RequestBlocks:
        state = self._requests[req_id] = _RequestBlocks(row=self._table.add_row())
        return state

    def _drop_state(self, req_id: str) -> _RequestBlocks:
        state = self._requests.pop(req_id)
        self._table.free_row(state.row)
        if state.prefetch is not None:
            self._drop_prefetch(state.prefetch)
            state.prefetch = None
        return state

    def _extend_hashes(self, req: Request, state: _RequestBlocks, num_tokens: int) -> None:
        """Hash the request's full blocks within its first ``num_tokens`` tokens that are not hashed yet."""
        start = len(state.block_hashes) * self._block_size
        end = num_tokens - (num_tokens - start) % self._block_size
        if end <= start:
            return
        parent = state.block_hashes[-1] if state.block_hashes else None
        state.block_hashes.extend(hash_blocks(req.all_token_ids[start:end], self._block_size, req.cache_salt, parent))
