"""Facts the MetaStore hands out: immutable snapshots, safe to keep after the lock is released.

Derived numbers (free blocks, bytes, totals) are properties, so counts cannot drift.
"""

from __future__ import annotations

from dataclasses import dataclass

from poolbackends.records import Allocation, Location, PoolRecord  # the same records on both sides of the wire

__all__ = ["Allocation", "LeaseGrant", "Location", "PoolRecord"]


@dataclass(frozen=True)
class LeaseGrant:
    """A granted lease. The holder releases it by ``lease_id`` or lets it expire at ``deadline``
    (seconds of the core's clock, ``ttl_ms`` after the grant)."""

    lease_id: int
    ttl_ms: int
    deadline: float
    locations: list[Location]


@dataclass(frozen=True)
class PoolOccupancy:
    pool: PoolRecord
    used_blocks: int
    objects: int
    complete_objects: int
    evictions: int
    heartbeat_age_ms: int

    @property
    def free_blocks(self) -> int:
        return self.pool.geometry.num_blocks - self.used_blocks

    @property
    def used_bytes(self) -> int:
        return self.used_blocks * self.pool.block_bytes

    @property
    def capacity_bytes(self) -> int:
        return self.pool.geometry.total_bytes


@dataclass(frozen=True)
class MetaStats:
    pools: list[PoolOccupancy]
    world_size: int
    lease_ttl_ms: int
    heartbeat_timeout_ms: int
    dram_bytes_per_local_service: int
    live_leases: int
    lease_expiries: int
    leases_dropped: int
    evictions: int
    pools_expired: int

    @property
    def objects(self) -> int:
        return sum(p.objects for p in self.pools)

    @property
    def complete_objects(self) -> int:
        return sum(p.complete_objects for p in self.pools)

    @property
    def used_bytes(self) -> int:
        return sum(p.used_bytes for p in self.pools)

    @property
    def capacity_bytes(self) -> int:
        return sum(p.capacity_bytes for p in self.pools)
