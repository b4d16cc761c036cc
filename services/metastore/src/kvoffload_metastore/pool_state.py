"""The index's mutable state, one entry per pool and per object: ``PoolState`` (a registered pool's
record, last heartbeat, keys, free block ids and LRU policy) and ``StoredObject`` (an object's pool,
block id and written planes). Plain data: ``MetaStoreCore`` changes it under its lock."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvcore.pool.eviction import LRUEviction
from kvoffload_metastore.records import PoolRecord


@dataclass
class StoredObject:
    pool: PoolState
    block_id: int
    written: set[int] = field(default_factory=set)

    @property
    def complete(self) -> bool:
        return len(self.written) == self.pool.record.geometry.num_planes


@dataclass
class PoolState:
    record: PoolRecord
    last_beat: float
    keys: set[bytes] = field(default_factory=set)
    recycled: list[int] = field(default_factory=list)  # freed block ids, reused first
    next_unused: int = 0  # blocks [next_unused, num_blocks) never used
    policy: LRUEviction = field(default_factory=LRUEviction)
    evictions: int = 0

    @property
    def free_blocks(self) -> int:
        return len(self.recycled) + self.record.geometry.num_blocks - self.next_unused

    def take_block(self) -> int:
        if self.recycled:
            return self.recycled.pop()
        self.next_unused += 1
        return self.next_unused - 1
