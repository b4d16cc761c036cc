"""The MetaStore's registry errors; object errors (``ObjectNotFound``, ``ObjectExists``,
``ObjectLeased``, ``PoolFullError``, ``LeaseExpired``) are kvcore's host-pool errors, so a caller
of ``MetaStoreClient`` handles the same types as a caller of ``kvcore.pool.local.LocalHostPool``."""

from __future__ import annotations

from typing import Any

from kvcore.pool.errors import PoolError


class PoolNotRegistered(PoolError):
    """No live pool with this id (never registered, deregistered, or expired)."""


class PoolConflict(PoolError):
    """``register_pool`` of a live pool id with another segment or geometry (and no ``replace``)."""


class WorldSizeExceeded(PoolError):
    """``world_size`` pools are registered already."""


class NoPoolRegistered(PoolError):
    """``alloc`` while no pool is registered."""


class MetaStoreUnavailable(PoolError):
    """The MetaStore could not be reached or did not answer in time (client side only).

    ``code`` is the ``grpc.StatusCode`` of the failed call (None if there was none)."""

    def __init__(self, message: str, *, code: Any = None) -> None:
        super().__init__(message)
        self.code = code
