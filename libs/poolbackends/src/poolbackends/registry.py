"""The calls that run a ``kvcore.pool.registry`` backend's hooks: ``open_pool`` (its factory, asked
with a ``PoolRequest``), ``readiness`` (its check of an open pool), ``start_server`` (its launcher)
and ``open_lookup`` (a ``PrefixLookup``: which blocks the pool holds, asked without a pool; the vLLM
store's scheduler).

The hooks live in this package's backend modules and are imported only here, when called: a service
that opens a pool depends on this package, and only the backend it runs is imported.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from kvcore.pool.geometry import PoolGeometry
from kvcore.pool.host_pool import HostPoolBackend
from kvcore.pool.registry import POOL_BACKENDS, load
from svcruntime.serverprocess import ServerProcess


class PoolOpenError(RuntimeError):
    """A backend's factory cannot open its pool here; the message says why (``open_pool`` names the backend)."""


@dataclass(frozen=True)
class PoolRequest:
    """What a service asks a backend's factory for: a pool of ``geometry`` on the backend of
    ``store`` (its ``kv_connector_extra_config``, a ``kvcore.config.connectors.StoreConnectorConfig``,
    which holds the backend's keys)."""

    store: Any
    geometry: PoolGeometry
    name: str  # the shared-memory segment an embedded pool creates
    pool_id: str  # how the pool's index names it (its metastore registration)
    host: str = ""  # where peers reach this process (Mooncake's local hostname); "": its address toward the server
    local_config: str | None = None  # the LocalService's mmc-local.conf (a backend with ``local_config``)
    timeout_s: float = 5.0  # how long the pool's server may take to answer a call (its connection, at start-up)


def open_pool(request: PoolRequest) -> HostPoolBackend:
    """The pool of ``request.store.backend``, opened by its factory; ``PoolOpenError`` naming the
    backend and why when it cannot open here (errors the factory does not expect pass unchanged)."""
    backend = POOL_BACKENDS[request.store.backend]
    try:
        return load(backend.factory)(request)
    except PoolOpenError as exc:
        raise PoolOpenError(f"backend {backend.name!r}: {exc}") from None


def readiness(name: str) -> Callable[[HostPoolBackend], str]:
    """Backend ``name``'s readiness check: ``(pool) -> why it cannot serve now`` ("" when it can)."""
    ref = POOL_BACKENDS[name].readiness
    return load(ref) if ref else (lambda pool: "")


def start_server(name: str) -> ServerProcess:
    """Start backend ``name``'s server on loopback (free ports) and return it once it answers
    (``stop()`` ends it)."""
    ref = POOL_BACKENDS[name].launcher
    if ref is None:
        raise ValueError(f"backend {name!r} has no server to start")
    return load(ref).start()


class PrefixLookup(Protocol):
    """Which blocks a backend's pools hold, asked of its index (a kvoffload-metastore, a mooncake_master)."""

    def exists(self, keys: Sequence[bytes]) -> list[bool]:
        """Per key: a complete object of the block is there; a ``kvcore.pool.host_pool.PoolError`` when the
        index does not answer."""
        ...

    def close(self) -> None: ...


def open_lookup(store: Any, timeout_s: float = 5.0) -> PrefixLookup:
    """The ``PrefixLookup`` of ``store.backend`` (its entry's ``lookup`` hook) on the server the store
    config names, each call bounded by ``timeout_s``; ``PoolOpenError`` naming the backend when it
    cannot open (a server that does not answer), ``ValueError`` for a backend without one."""
    backend = POOL_BACKENDS[store.backend]
    if backend.lookup is None:
        raise ValueError(f"backend {backend.name!r} has no lookup: {backend.vllm_refusal}")
    try:
        return load(backend.lookup)(store, timeout_s)
    except PoolOpenError as exc:
        raise PoolOpenError(f"backend {backend.name!r}: {exc}") from None
