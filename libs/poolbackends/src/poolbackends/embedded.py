"""Backend ``"kvoffload"`` (the embedded host pool), as its ``kvcore.pool.registry`` entry opens it:
indexed by the kvoffload-metastore of the store config's ``metastore`` (a ``RemoteHostPool``), or
without one in this process (a ``kvcore.pool.local.LocalHostPool``); its lookup is that metastore's
``Exists`` (``open_lookup``)."""

from __future__ import annotations

from kvcore.pool.eviction import LRUEviction
from kvcore.pool.host_pool import HostPoolBackend
from kvcore.pool.local import LocalHostPool
from poolbackends.client import MetaStoreClient
from poolbackends.registry import PoolRequest
from poolbackends.remotepool import RemoteHostPool


def open_pool(request: PoolRequest) -> HostPoolBackend:
    """The embedded pool of ``request``: registered with the metastore as ``request.pool_id`` (a stale
    segment or registration of the same name is replaced, and a restarted metastore gets the pool
    registered again rather than retiring it), or kept in this process without a metastore."""
    metastore = request.store.metastore
    if not metastore:
        return LocalHostPool.create(request.name, request.geometry, eviction=LRUEviction())
    return RemoteHostPool.create(
        metastore,
        request.pool_id,
        request.name,
        request.geometry,
        replace=True,
        rejoin=True,
        timeout_s=request.timeout_s,
    )


def pool_not_ready(pool: HostPoolBackend) -> str:
    """Why the pool cannot serve now ("" when it can): a ``RemoteHostPool`` not registered with the
    metastore, or a metastore that does not answer; a ``LocalHostPool`` is always ready."""
    return pool.not_ready() if isinstance(pool, RemoteHostPool) else ""


def open_lookup(store, timeout_s: float) -> MetaStoreClient:
    """The metastore of ``store.metastore`` as a ``poolbackends.registry.PrefixLookup`` (its ``Exists``);
    the channel connects on the first call."""
    if not store.metastore:
        raise ValueError("backend 'kvoffload' looks blocks up in its metastore: the store config names none")
    return MetaStoreClient(store.metastore, timeout_s=timeout_s)
