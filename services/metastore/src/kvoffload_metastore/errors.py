"""The metastore's own error: ``PoolFull``, a ``PoolFullError`` naming the pool. Every other
error type, and how each travels as a gRPC status, is ``poolbackends``'s (``poolbackends.errors``,
``poolbackends.wire``), shared with the client so both sides speak one vocabulary."""

from __future__ import annotations

from kvcore.pool.errors import PoolFullError


class PoolFull(PoolFullError):
    """``PoolFullError`` naming the pool and the first key that does not fit."""

    def __init__(
        self, *, pool_id: str, key: bytes | None, needed: int, free: int, evictable: int, num_blocks: int
    ) -> None:
        super().__init__(key=key, needed=needed, free=free, evictable=evictable, num_blocks=num_blocks, policy="LRU")
        self.pool_id = pool_id
        self.num_blocks = num_blocks
        self.args = (f"pool {pool_id!r}: {self.args[0]} (first key that does not fit: {key!r})",)
