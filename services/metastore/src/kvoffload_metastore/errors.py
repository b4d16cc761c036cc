"""The MetaStore's error vocabulary and how each error travels as a gRPC status.

Object errors are kvcore's host-pool exceptions (``ObjectNotFound``, ``ObjectExists``,
``ObjectLeased``, ``PoolFullError``, ``LeaseExpired``), so a caller of ``MetaStoreClient`` handles
the same types as a caller of ``kvcore.hostpool.LocalHostPool``. Pool-registry errors and the
trailing-metadata keys are defined in ``kvcore.metaclient`` (next to the client, which kvcore
backends use) and re-exported here. ``STATUS`` maps each type to its status code (metastore.proto
lists them); the servicer adds the trailing metadata below so that the client rebuilds the exact
type, key and numbers.
"""

from __future__ import annotations

import grpc
from kvcore import metaclient
from kvcore.hostpool import (
    LeaseExpired,
    ObjectExists,
    ObjectLeased,
    ObjectNotFound,
    PoolFullError,
)
from kvcore.metaclient import (  # the registry errors and wire keys live in kvcore, shared with the client
    ERROR_MD,
    FULL_MD,
    KEY_MD,
    MetaStoreUnavailable,
    NoPoolRegistered,
    PoolConflict,
    PoolNotRegistered,
    WorldSizeExceeded,
)

__all__ = ["ERROR_MD", "FULL_MD", "KEY_MD", "MetaStoreUnavailable", "NoPoolRegistered", "PoolConflict",
           "PoolNotRegistered", "WorldSizeExceeded", "PoolFull", "STATUS", "BY_NAME", "status_of",
           "trailing_metadata", "message_of"]


class PoolFull(PoolFullError):
    """``PoolFullError`` naming the pool and the first key that does not fit."""

    def __init__(self, *, pool_id: str, key: bytes | None, needed: int, free: int, evictable: int,
                 num_blocks: int) -> None:
        super().__init__(key=key, needed=needed, free=free, evictable=evictable, num_blocks=num_blocks,
                         policy="LRU")
        self.pool_id = pool_id
        self.num_blocks = num_blocks
        self.args = (f"pool {pool_id!r}: {self.args[0]} (first key that does not fit: {key!r})",)


STATUS: dict[type[BaseException], grpc.StatusCode] = {
    ValueError: grpc.StatusCode.INVALID_ARGUMENT,
    ObjectNotFound: grpc.StatusCode.NOT_FOUND,
    LeaseExpired: grpc.StatusCode.NOT_FOUND,
    PoolNotRegistered: grpc.StatusCode.NOT_FOUND,
    ObjectExists: grpc.StatusCode.ALREADY_EXISTS,
    PoolConflict: grpc.StatusCode.ALREADY_EXISTS,
    PoolFullError: grpc.StatusCode.RESOURCE_EXHAUSTED,
    ObjectLeased: grpc.StatusCode.FAILED_PRECONDITION,
    WorldSizeExceeded: grpc.StatusCode.FAILED_PRECONDITION,
    NoPoolRegistered: grpc.StatusCode.FAILED_PRECONDITION,
}

# Types a client may rebuild from the ERROR_MD name: kvcore.metaclient's map (it checks the codes above).
BY_NAME = metaclient.BY_NAME


def status_of(exc: BaseException) -> grpc.StatusCode | None:
    """The status code of a known error type (most specific first), else None."""
    for cls in type(exc).__mro__:
        if cls in STATUS:
            return STATUS[cls]
    return None


def trailing_metadata(exc: BaseException) -> tuple[tuple[str, str | bytes], ...]:
    """Metadata that lets the client rebuild ``exc`` (type name, key, PoolFullError numbers)."""
    md: list[tuple[str, str | bytes]] = [(ERROR_MD, type(exc).__name__)]
    key = getattr(exc, "key", None)
    if isinstance(key, bytes):
        md.append((KEY_MD, key))
    if isinstance(exc, PoolFullError):
        numbers = {"needed": exc.needed, "free": exc.free, "evictable": exc.evictable,
                   "num_blocks": getattr(exc, "num_blocks", 0)}
        md.extend((key, str(numbers[name])) for name, key in FULL_MD.items())
    return tuple(md)


def message_of(exc: BaseException) -> str:
    """The status message: the error text, naming the key when the text does not already."""
    text = str(exc)
    key = getattr(exc, "key", None)
    if isinstance(key, bytes) and repr(key) not in text:
        text = f"{text} (key {key!r})"
    return text
