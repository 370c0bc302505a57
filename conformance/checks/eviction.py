"""The eviction-policy contract, checked against a model of the block pool's bookkeeping.

The harness sends a policy the calls the block pool makes (``rtxcore/kv/block_pool.py``) and keeps its own record
of which blocks are candidates and which are in use. Blocks in use include *pinned* ones: cached blocks held by a
prefix-cache hit, which the policy hears about through ``touch`` while it must never return them.
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from rtx_conformance.rules import require
from rtxcore.contracts.eviction import EvictionPolicy

# Pool events, in the order the pool emits the policy calls for each.
CACHE_NEW = 0  # a free block is handed out and cached under a content key: cached()
RELEASE = 1  # its last user leaves: add()
HIT_CANDIDATE = 2  # a prefix hit takes a candidate back: remove(), then touch()
HIT_IN_USE = 3  # a prefix hit on a block someone already holds (pinning it further): touch()
EVICT = 4  # the pool needs a block: evict()
RESET = 5  # the prefix cache is reset: remove() for candidates, then forget() for every cached block
NUM_EVENTS = 6

# Entries of every container a policy keeps, per block of capacity, plus a constant.
METADATA_PER_BLOCK = 8
METADATA_CONSTANT = 64


@dataclass(slots=True)
class PoolModel:
    capacity: int
    candidates: set[int]
    in_use: set[int]

    @classmethod
    def empty(cls, capacity: int) -> PoolModel:
        return cls(capacity, set(), set())

    @property
    def cached(self) -> set[int]:
        return self.candidates | self.in_use

    def free_blocks(self) -> list[int]:
        # Block 0 is the pool's null block: never handed out.
        return [b for b in range(1, self.capacity) if b not in self.candidates and b not in self.in_use]


def run_events(policy: EvictionPolicy, events: Iterable[tuple[int, int]], model: PoolModel | None = None) -> PoolModel:
    """Apply ``(event, choice)`` pairs (``choice`` picks the block among those the event applies to) and check every
    rule after each. Events that apply to no block are skipped."""
    model = model or PoolModel.empty(policy.capacity)
    for number, (event, choice) in enumerate(events):
        calls = _apply(policy, model, event, choice, number)
        _check_agreement(policy, model, number, calls)
    return model


def random_events(rng: random.Random, count: int) -> list[tuple[int, int]]:
    """A long mixed sequence, weighted toward hits (the calls that grow recency and frequency metadata)."""
    weights = [3, 3, 2, 4, 2, 0.05]
    return [(rng.choices(range(NUM_EVENTS), weights)[0], rng.randrange(1 << 16)) for _ in range(count)]


def check_bounded_metadata(policy: EvictionPolicy, model: PoolModel, after: str) -> int:
    entries = count_entries(policy)
    bound = METADATA_PER_BLOCK * policy.capacity + METADATA_CONSTANT
    require(entries <= bound, "eviction.bounded_metadata",
            f"{entries} container entries after {after} with capacity {policy.capacity} (bound {bound})")
    return entries


def count_entries(obj: object) -> int:
    """Entries in the containers an object keeps (its attributes, and containers inside them, two levels deep)."""
    values = list(vars(obj).values()) if hasattr(obj, "__dict__") else []
    for cls in type(obj).__mro__:
        for slot in getattr(cls, "__slots__", ()):
            if hasattr(obj, slot):
                values.append(getattr(obj, slot))
    return sum(_entries(v, depth=2) for v in values)


def _entries(value: object, depth: int) -> int:
    if isinstance(value, (str, bytes)) or depth == 0:
        return 0
    if isinstance(value, dict):
        items: Sequence = list(value.values())
    elif isinstance(value, (list, tuple, set, frozenset)) or hasattr(value, "__len__") and hasattr(value, "__iter__"):
        try:
            items = list(value)
        except TypeError:
            return 0
    else:
        return 0
    return len(items) + sum(_entries(v, depth - 1) for v in items)


def _pick(blocks: Iterable[int], choice: int) -> int | None:
    ordered = sorted(blocks)
    return ordered[choice % len(ordered)] if ordered else None


def _apply(policy: EvictionPolicy, model: PoolModel, event: int, choice: int, number: int) -> str:
    """Make the event's calls; returns them as text (``"remove(5), touch(5)"``), empty when the event applied to no
    block."""
    if event == CACHE_NEW:
        block = _pick(model.free_blocks(), choice)
        if block is None:
            return ""
        model.in_use.add(block)
        # Keys from a space about twice the capacity: content comes back after eviction, as in a real cache.
        policy.cached(block, (choice % (2 * model.capacity)).to_bytes(16, "little"))
        return f"cached({block}, key)"
    if event == RELEASE:
        block = _pick(model.in_use, choice)
        if block is None:
            return ""
        model.in_use.remove(block)
        model.candidates.add(block)
        policy.add(block)
        return f"add({block})"
    if event == HIT_CANDIDATE:
        block = _pick(model.candidates, choice)
        if block is None:
            return ""
        model.candidates.remove(block)
        model.in_use.add(block)
        policy.remove(block)
        policy.touch(block)
        return f"remove({block}), touch({block})"
    if event == HIT_IN_USE:
        block = _pick(model.in_use, choice)
        if block is None:
            return ""
        policy.touch(block)
        return f"touch({block})"
    if event == EVICT:
        return f"evict() -> {_evict(policy, model, number)!r}"
    if event == RESET:
        for block in sorted(model.candidates):
            policy.remove(block)
        for block in sorted(model.cached):
            policy.forget(block)
        model.candidates.clear()
        model.in_use.clear()
        return "remove() of every candidate, forget() of every cached block"
    return ""


def _evict(policy: EvictionPolicy, model: PoolModel, number: int) -> int | None:
    victim = policy.evict()
    require(victim is None or (isinstance(victim, int) and not isinstance(victim, bool)), "eviction.api",
            f"event {number}: evict() returned {victim!r} ({type(victim).__name__}): a block id (int) or None")
    require(victim not in model.in_use, "eviction.only_candidates",
            f"event {number}: evicted block {victim}, which is in use")
    if not model.candidates:
        require(victim is None, "eviction.evicts_when_asked",
                f"event {number}: evict() returned {victim!r} with no candidate")
        return None
    require(victim is not None, "eviction.evicts_when_asked",
            f"event {number}: evict() returned None with {len(model.candidates)} candidate(s)")
    require(victim in model.candidates, "eviction.only_candidates",
            f"event {number}: evicted block {victim!r}, which is not a candidate "
            f"(candidates: {sorted(model.candidates)[:8]}...)")
    model.candidates.remove(victim)
    return victim


def _check_agreement(policy: EvictionPolicy, model: PoolModel, number: int, calls: str) -> None:
    """len() and ``in`` against the pool's own record; called directly, so that a wrong type shows (``len()`` and
    ``in`` would convert it)."""
    rule = "eviction.tracks_candidates"
    after = f"after event {number}, {calls}" if calls else f"after event {number}"
    for block in range(policy.capacity):
        held = policy.__contains__(block)
        require(isinstance(held, bool), "eviction.api",
                f"{after}: __contains__({block}) returned {held!r} ({type(held).__name__}), not a bool")
        if held and block not in model.candidates:
            taken = "the pool took it back with remove()" if block in model.in_use else "it was evicted or forgotten"
            require(False, rule, f"{after}: block {block} is still a candidate for the policy, but {taken}")
        require(held or block not in model.candidates, rule,
                f"{after}: block {block} is no longer a candidate for the policy, but nothing took it (no remove, "
                f"forget or evict of it)")
    size = policy.__len__()
    require(isinstance(size, int) and not isinstance(size, bool), "eviction.api",
            f"{after}: __len__() returned {size!r} ({type(size).__name__}), not an int")
    require(size == len(model.candidates), rule,
            f"{after}: len(policy) is {size}, but the pool has {len(model.candidates)} candidates")
