"""CPU-only factories for the KV-cache tests."""

from __future__ import annotations

import itertools
from typing import Sequence

from rtx_plugins.eviction.arc import ARCPolicy
from rtx_plugins.eviction.lfu import LFUPolicy
from rtx_plugins.eviction.lru import LRUPolicy
from rtxcore.contracts.eviction import EvictionPolicy
from rtxcore.kv.block_pool import BlockPool
from rtxcore.kv.manager import KVCacheManager
from rtxcore.request import Request
from rtxcore.sampling_params import SamplingParams

POLICIES: dict[str, type[EvictionPolicy]] = {"lru": LRUPolicy, "lfu": LFUPolicy, "arc": ARCPolicy}

_req_ids = itertools.count()


def make_request(
    tokens: Sequence[int],
    req_id: str | None = None,
    cache_salt: str | None = None,
    max_tokens: int = 16,
) -> Request:
    return Request(
        req_id=req_id if req_id is not None else f"req-{next(_req_ids)}",
        prompt_token_ids=list(tokens),
        params=SamplingParams(max_tokens=max_tokens),
        cache_salt=cache_salt,
    )


def make_pool(num_blocks: int = 8, policy: str = "lru") -> BlockPool:
    return BlockPool(num_blocks, POLICIES[policy](num_blocks))


def make_manager(
    num_blocks: int = 16,
    block_size: int = 4,
    policy: str = "lru",
    enable_prefix_caching: bool = True,
) -> KVCacheManager:
    return KVCacheManager(num_blocks, block_size, POLICIES[policy](num_blocks), enable_prefix_caching)


def schedule(kv: KVCacheManager, req: Request, num_new_tokens: int | None = None) -> bool:
    """What a scheduler does for one request: look up its prefix on first admission, then allocate and compute.

    ``num_new_tokens`` defaults to every token not yet computed. On success the tokens count as computed.
    """
    if req.num_computed_tokens == 0:
        req.num_computed_tokens = kv.lookup_prefix(req)
    if num_new_tokens is None:
        num_new_tokens = req.num_tokens - req.num_computed_tokens
    if not kv.allocate(req, num_new_tokens):
        return False
    req.num_computed_tokens += num_new_tokens
    return True
