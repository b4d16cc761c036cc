"""The host KV pool's typed errors. Each carries ``key``, the first offending key (None if the
error is not about one key); every backend raises these, so callers handle one vocabulary."""

from __future__ import annotations


class PoolError(RuntimeError):
    """Base of host-pool failures; ``key`` is the first offending key (None if not about one)."""

    def __init__(self, message: str, *, key: bytes | None = None) -> None:
        super().__init__(message)
        self.key = key


class ObjectNotFound(PoolError):
    """The key has no object (never allocated, removed, or evicted)."""


class IncompleteObject(PoolError):
    """The object exists but not every plane is written (or a write is in progress)."""


class ObjectUnreachable(PoolError):
    """The object is listed but its bytes cannot be read: the process that held them is gone (a
    distributed store's dead owner, listed until the store notices). The backend has removed it,
    so ``exists`` now misses it and the caller may compute those blocks again."""


class ObjectExists(PoolError):
    """``alloc`` of a key that already has an object."""


class ObjectLeased(PoolError):
    """The object is protected by a live read lease."""


class PlaneWritten(PoolError):
    """``put_from`` of other bytes over a plane already written: written planes are write-once."""


class ObjectBusy(PoolError):
    """An in-flight copy of the object did not finish within ``io_wait_timeout_s``."""


class LeaseExpired(PoolError):
    """``renew`` of a lease that expired or was released; its objects may be gone."""


class PoolFullError(PoolError):
    """No room for ``needed`` blocks: ``free`` free blocks plus ``evictable`` evictable ones."""

    def __init__(
        self, *, key: bytes | None, needed: int, free: int, evictable: int = 0, num_blocks: int = 0, policy: str = ""
    ) -> None:
        super().__init__(
            f"host pool full: {needed} block(s) needed, {free} free + {evictable} evictable of {num_blocks} "
            f"(eviction policy {policy or '?'}); release leases, remove finished requests, or enlarge the pool",
            key=key,
        )
        self.needed = needed
        self.free = free
        self.evictable = evictable
