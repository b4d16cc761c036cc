"""``AttachedPool``: a decode TP follower's view of its DP rank's host pool, which rank 0 indexes.

A decode of TP N keeps one host pool per DP rank (the guide's ``dram_size_per_dp_GB``): rank 0
creates it (a ``LocalHostPool`` over a ``SharedSegment``) and is the only one that allocates and
frees its blocks. Ranks 1..N-1 attach the segment and write and read rows at the block ids rank 0
handed out: with every allocation rank 0 makes for a request, its op to the followers carries the
ids (``kvoffload_engine.tp_decode``), and a follower ``give``s them to this view before it applies
the op, so its own ``alloc`` (the same call rank 0 made, in the same order) takes them. The rows of
every rank are the same (the latent KV is replicated), so a row written by two ranks holds the same
bytes either way.

What the view counts is what this rank's requests reference (``stats``: its used blocks), never the
pool's capacity a second time: the pool's own figures are rank 0's.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from typing import TYPE_CHECKING

from kvcore.pool.errors import PoolError

if TYPE_CHECKING:
    import torch

    from kvcore.pool.geometry import PoolGeometry
    from kvcore.pool.host_pool import PoolStats
    from kvcore.pool.segment import SharedSegment


class AttachedPool:
    """The blocks of rank 0's pool that this rank's requests hold (module doc). Not thread-safe: its
    decoder's caller serializes the calls, as for the decoder."""

    def __init__(self, segment: SharedSegment) -> None:
        self._segment = segment
        self._given: deque[list[int]] = deque()  # rank 0's allocations not taken yet, in order
        self._held: dict[bytes, int] = {}  # key -> block id, this rank's requests' blocks

    @classmethod
    def attach(cls, name: str) -> AttachedPool:
        """The view of the segment ``name`` (rank 0's pool: ``LocalHostPool.segment.name``)."""
        from kvcore.pool.segment import SharedSegment

        return cls(SharedSegment.attach(name))

    @property
    def segment(self) -> SharedSegment:
        return self._segment

    @property
    def geometry(self) -> PoolGeometry:
        return self._segment.geometry

    def plane(self, p: int) -> torch.Tensor:
        """uint8 view ``[num_blocks, block_size, row_bytes_p]`` of plane p of the shared pool."""
        return self._segment.plane(p)

    def give(self, block_ids: Sequence[int]) -> None:
        """The ids of rank 0's next allocation: the next ``alloc`` takes them."""
        self._given.append([int(b) for b in block_ids])

    def alloc(self, keys: Sequence[bytes]) -> list[int]:
        """The block ids rank 0 allocated for ``keys`` (``give``); a follower out of step with rank 0
        (nothing given, or a different count) raises instead of writing anywhere."""
        if not self._given:
            raise PoolError(f"TP follower: rank 0 gave no block ids for the {len(keys)} blocks asked for")
        ids = self._given.popleft()
        if len(ids) != len(keys):
            raise PoolError(f"TP follower: rank 0 gave {len(ids)} block ids for {len(keys)} blocks")
        taken = [k for k in keys if k in self._held]
        if taken:
            raise PoolError(f"TP follower: {len(taken)} of the keys already hold blocks (first {taken[0]!r})")
        self._held.update(zip(keys, ids, strict=True))
        return ids

    def remove(self, keys: Sequence[bytes]) -> None:
        """This rank's request no longer references ``keys`` (rank 0 frees the blocks)."""
        for k in keys:
            self._held.pop(k, None)

    def can_alloc(self, keys: Sequence[bytes]) -> bool:
        raise PoolError("a TP follower does not decide what fits: rank 0's pool does")

    def stats(self) -> PoolStats:
        """This rank's view: the blocks its requests reference as used; capacity, leases, evictions
        are rank 0's pool's business and read 0 here."""
        from kvcore.pool.host_pool import PoolStats

        g, used = self.geometry, len(self._held)
        return PoolStats(
            num_blocks=g.num_blocks,
            used_blocks=used,
            free_blocks=g.num_blocks - used,
            used_bytes=used * g.block_bytes,
            capacity_bytes=0,
            complete_objects=0,
            live_leases=0,
            lease_expiries=0,
            evictions=0,
        )

    def close(self) -> None:
        """Unmap the segment (rank 0 unlinks it). Idempotent."""
        self._given.clear()
        self._held.clear()
        self._segment.close()
