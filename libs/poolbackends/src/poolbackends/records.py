"""Records the MetaStore hands out: immutable snapshots, the same on both sides of the wire."""

from __future__ import annotations

from dataclasses import dataclass

from kvcore.pool.geometry import PoolGeometry


@dataclass(frozen=True)
class PoolRecord:
    """A registered pool: ``segment_name`` to ``SharedSegment.attach`` on host ``host``."""

    pool_id: str
    segment_name: str
    host: str
    geometry: PoolGeometry

    @property
    def block_bytes(self) -> int:
        return self.geometry.block_bytes


@dataclass(frozen=True)
class Location:
    key: bytes
    pool_id: str
    block_id: int
    size_bytes: int
    written_planes: tuple[int, ...]
    complete: bool


@dataclass(frozen=True)
class Allocation:
    pool: PoolRecord
    block_ids: list[int]
    evicted: int
