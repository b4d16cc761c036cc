"""Where an allocation goes: the pools to try (the hinted one, or every pool by free room) and, in
the first that can hold the keys, the complete unleased objects its LRU policy gives up to make
room. No side effects: ``MetaStoreCore`` plans under its lock, then allocates (or only checks).
"""

from __future__ import annotations

from collections.abc import Callable

from kvcore.pool.errors import ObjectExists
from kvoffload_metastore.errors import PoolFull
from kvoffload_metastore.pool_state import PoolState, StoredObject
from poolbackends.errors import NoPoolRegistered


def check_absent(objects: dict[bytes, StoredObject], keys: list[bytes]) -> None:
    """``ObjectExists`` for the first of ``keys`` that already has an object."""
    for k in keys:
        obj = objects.get(k)
        if obj is not None:
            raise ObjectExists(
                f"key {k!r} already has an object (pool {obj.pool.record.pool_id!r}, block {obj.block_id})", key=k
            )


def candidates(
    pools: dict[str, PoolState], pool_hint: str | None, require_hint: bool, pool_of: Callable[[str], PoolState]
) -> list[PoolState]:
    """The pools to try, in order: the hinted one (``pool_of`` raises when it is not registered),
    then — unless ``require_hint`` — the others by free room, most first."""
    if not pools:
        raise NoPoolRegistered("no pool is registered: start a LocalService (prefill or decode) first")
    by_room = sorted(pools.values(), key=lambda p: (-p.free_blocks, p.record.pool_id))
    if not pool_hint:
        if require_hint:
            raise ValueError("require_hint needs a pool_hint")
        return by_room
    hinted = pool_of(pool_hint)
    return [hinted] if require_hint else [hinted] + [p for p in by_room if p is not hinted]


def choose_pool(
    pools: list[PoolState], keys: list[bytes], can_evict: Callable[[bytes], bool]
) -> tuple[PoolState, list[bytes]]:
    """(pool, victims): the first of ``pools`` whose free blocks, with the victims its LRU policy
    gives up (``can_evict``), hold ``keys``; ``PoolFull`` naming the first pool tried otherwise."""
    n = len(keys)
    shortfalls = []
    for pool in pools:
        free = pool.free_blocks
        victims = pool.policy.victims(n - free, can_evict) if n > free else []
        if free + len(victims) >= n:
            return pool, victims
        shortfalls.append((pool, free, len(victims)))
    pool, free, evictable = shortfalls[0]
    raise PoolFull(
        pool_id=pool.record.pool_id,
        key=keys[free + evictable],
        needed=n,
        free=free,
        evictable=evictable,
        num_blocks=pool.record.geometry.num_blocks,
    )
