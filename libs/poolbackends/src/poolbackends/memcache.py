"""``MemcacheHostPool``: the host KV pool over Memcache (``memcache_hybrid``, ``backend: "memcache"``).

Start-up. ``MemcacheHostPool.connect(geometry, local_config=...)`` first starts its Memcache
LocalService (``poolbackends.memcache_client.MemcacheClient``) from the ``mmc-local.conf`` given, or
from one generated from ``LocalSettings`` (the MetaService's URLs from the caller, ``dram.size``
sized for the geometry unless the settings say more). Only when that succeeds does it create any
memory of its own. Where the data path cannot start (no Ascend driver: every protocol of
memcache_hybrid 1.3.0 needs one) construction raises ``MemcacheUnavailable`` naming the cause in
the library's own words; there is no fall-back to the embedded pool. Not run here: everything
below needs a started LocalService, i.e. an Ascend host; it follows memcache_hybrid 1.3.0's API.

Where bytes live. A ``MemcacheHostPool`` is a ``poolbackends.storepool.StoreHostPool`` (a
``kvcore.pool.local.LocalHostPool``) over its own ``SharedSegment`` (``kvoffload-memcache-<pool
id>``), registered with the client (``register_buffer``); the index, free list, written planes,
pins, leases, eviction and stats are ``LocalHostPool``'s, and its hook map holds ("blocks: lock
only" reads "plus bounded Memcache calls" where a hook below calls the store). Memcache is the
shared layer: when ``put_from`` writes an object's last plane, the object is put as ONE Memcache
object with one layer per plane (``batch_put_from_layers`` from the block's rows in the planes,
key ``<namespace>/<key hex>``), under the lock; a failed put leaves the plane unwritten. Keys this
pool does not hold are looked up in Memcache, as ``StoreHostPool`` says. The pool that
allocated an object owns it: its eviction, ``remove`` and ``close`` remove the Memcache copy too
(all or nothing: copies removed before a failure are put back from the local planes).

Leases. Local leases are ``LocalHostPool``'s. A lease on keys held only in Memcache also takes
Memcache's read lease for the same TTL (``batch_add_lease``), so their owner cannot remove them
meanwhile; it is not released early (it ends with its TTL). A failed Memcache call raises
``MemcacheStoreError`` (a ``PoolError``) with the library's code and the key.

As backend ``"memcache"`` of ``kvcore.pool.registry``: ``open_pool`` (the LocalService of the
request's mmc-local.conf).
"""

from __future__ import annotations

import dataclasses

import structlog
import torch

from kvcore.pool.eviction import EvictionPolicy, LRUEviction
from kvcore.pool.geometry import PoolGeometry
from kvcore.pool.host_pool import ObjectNotFound, PoolError
from kvcore.pool.segment import SharedSegment
from poolbackends.memcache_client import MemcacheClient, MemcacheStoreError, MemcacheUnavailable
from poolbackends.memcache_conf import LocalSettings
from poolbackends.memcache_meta import MemcacheNotInstalled
from poolbackends.registry import PoolOpenError, PoolRequest
from poolbackends.storepool import StoreHostPool, owning, store_bytes_for

log = structlog.get_logger(__name__)

dram_bytes_for = store_bytes_for  # ``dram.size`` of a LocalService that holds every object of a geometry


class MemcacheHostPool(StoreHostPool):
    """A ``StoreHostPool`` whose objects are shared through Memcache (see the module docstring).

    ``MemcacheHostPool(client, geometry)`` uses a started ``MemcacheClient`` and leaves it open on
    ``close``; ``MemcacheHostPool.connect(...)`` starts its own and closes it on ``close``. Pools
    that share objects use the same ``namespace``.
    """

    STORE = "Memcache"

    def __init__(
        self,
        client: MemcacheClient,
        geometry: PoolGeometry,
        *,
        namespace: str = "kvoffload",
        eviction: EvictionPolicy | None = None,
        io_wait_timeout_s: float = 30.0,
        owns_client: bool = False,
    ) -> None:
        if not isinstance(client, MemcacheClient):
            raise ValueError(f"client must be a started MemcacheClient, got {type(client).__name__}")
        if not client.contributes_memory:
            raise ValueError(
                "client must contribute memory (MemcacheClient.connect(contribute_memory=True)): "
                "a metadata-only client cannot put objects"
            )
        self._client, self._owns_client = client, owns_client
        super().__init__(
            geometry, prefix="memcache", namespace=namespace, eviction=eviction, io_wait_timeout_s=io_wait_timeout_s
        )

    @classmethod
    def connect(
        cls,
        geometry: PoolGeometry,
        *,
        local_config: str | None = None,
        settings: LocalSettings | None = None,
        device_id: int = 0,
        namespace: str = "kvoffload",
        eviction: EvictionPolicy | None = None,
        io_wait_timeout_s: float = 30.0,
    ) -> MemcacheHostPool:
        """Start a LocalService from ``local_config`` (an ``mmc-local.conf``) or ``settings`` (exactly
        one; a ``settings.dram_bytes`` below the geometry's need is raised to it), then the pool.
        ``MemcacheUnavailable`` when the library cannot start here: no pool is built."""
        if not isinstance(geometry, PoolGeometry):
            raise ValueError(f"geometry must be a PoolGeometry, got {type(geometry).__name__}")
        if (local_config is None) == (settings is None):
            raise ValueError("give exactly one of local_config (an mmc-local.conf path) and settings (LocalSettings)")
        conf: str | LocalSettings
        if settings is not None:
            need = dram_bytes_for(geometry)
            conf = settings if settings.dram_bytes >= need else dataclasses.replace(settings, dram_bytes=need)
        else:
            conf = local_config  # type: ignore[assignment]
        client = MemcacheClient.connect(conf, device_id=device_id, contribute_memory=True)
        return owning(
            client,
            lambda: cls(
                client,
                geometry,
                namespace=namespace,
                eviction=eviction,
                io_wait_timeout_s=io_wait_timeout_s,
                owns_client=True,
            ),
        )

    @property
    def client(self) -> MemcacheClient:
        return self._client

    def key(self, key: bytes) -> str:
        return f"{self.namespace}/{key.hex()}"

    def _fail(self, op: str, code: int, key: bytes | None, n: int) -> MemcacheStoreError:
        return MemcacheStoreError(
            f"Memcache {op} of {n} object(s) failed with code {code} (MetaService "
            f"{self._client.meta_service_url}, pool {self.pool_id[:8]}, namespace "
            f"{self.namespace!r})",
            code=code,
            key=key,
        )

    # ---- the store primitives of StoreHostPool -------------------------------------------------

    def _attach(self, segment: SharedSegment) -> None:
        planes = [segment.plane(p) for p in range(segment.geometry.num_planes)]
        self._base = planes[0].data_ptr() - segment.plane_offsets[0]  # the mapping's start
        self._part_base = [t.data_ptr() for t in planes]
        code = self._client.register(self._base, segment.size_bytes)
        if code != 0:
            raise MemcacheStoreError(
                f"Memcache register_buffer of the pool's {segment.size_bytes} B segment "
                f"failed with {code} ({self._client})",
                code=code,
            )

    def _store_put(self, keys: list[bytes], ids: list[int]) -> None:
        """Put objects ``keys`` from blocks ``ids``, one layer per plane, all or none."""
        if not keys:
            return
        ptrs = [[b + i * pb for b, pb in zip(self._part_base, self._part_bytes)] for i in ids]
        codes = self._client.put_layers([self.key(k) for k in keys], ptrs, [self._part_bytes] * len(keys))
        bad = next((i for i, c in enumerate(codes) if c != 0), None)
        if bad is not None:
            self._client.remove([self.key(k) for k, c in zip(keys, codes) if c == 0])
            raise self._fail("put", codes[bad], keys[bad], len(keys))

    def _store_remove(self, keys: list[bytes]) -> dict[bytes, str]:
        """A copy that stays (a reader's lease, or any error) puts the removed ones back and is refused."""
        codes = self._client.remove([self.key(k) for k in keys])
        failed = [(k, c) for k, c in zip(keys, codes) if c != 0]
        if not failed:
            return {}
        still = [k for (k, _), e in zip(failed, self._client.exists([self.key(k) for k, _ in failed])) if e != 0]
        if not still:
            return {}
        removed = [k for k in keys if k not in set(still)]
        self._store_put(removed, [self._index[k] for k in removed])
        code = dict(failed)[still[0]]
        return {k: f"Memcache kept its copy (remove returned {code}: a reader elsewhere may lease it)" for k in still}

    def _store_exists(self, keys: list[bytes], op: str) -> list[bool]:
        codes = self._client.exists([self.key(k) for k in keys])
        bad = next((i for i, c in enumerate(codes) if c < 0), None)
        if bad is not None:
            raise self._fail(f"exists (for {op})", codes[bad], keys[bad], len(keys))
        return [c == 1 for c in codes]

    def _store_lease(self, keys: list[bytes], ttl_ms: int) -> list[bool]:
        """Memcache's read lease for ``ttl_ms`` (``batch_add_lease``): not released early."""
        return [c == 0 for c in self._client.add_lease([self.key(k) for k in keys], ttl_ms)]

    def _store_read(self, keys: list[bytes], staging: torch.Tensor) -> None:
        g = self.geometry
        base = staging.data_ptr()
        code = self._client.register(base, staging.numel())
        if code != 0:
            raise self._fail("register_buffer (read staging)", code, None, len(keys))
        offs = [sum(self._part_bytes[:p]) for p in range(g.num_planes)]
        try:
            codes = self._client.get_layers(
                [self.key(k) for k in keys],
                [[base + i * g.block_bytes + o for o in offs] for i in range(len(keys))],
                [self._part_bytes] * len(keys),
            )
        finally:
            self._client.unregister(base, staging.numel())
        for k, c in zip(keys, codes):
            if c != 0:
                if self._client.exists([self.key(k)])[0] == 0:
                    raise ObjectNotFound(f"no object for key {k!r} in this pool or in Memcache", key=k)
                raise self._fail("get", c, k, len(keys))

    def _store_remove_all(self, keys: list[bytes]) -> None:
        codes = self._client.remove([self.key(k) for k in keys])
        bad = next((c for c in codes if c != 0), None)
        if bad is not None:
            raise self._fail("remove (closing)", bad, None, len(keys))

    def _detach(self) -> None:
        self._client.unregister(self._base, self.segment.size_bytes)
        if self._owns_client:
            self._client.close()

    def __repr__(self) -> str:
        return (
            f"MemcacheHostPool({self.pool_id[:8]}, meta={self._client.meta_service_url!r}, "
            f"namespace={self.namespace!r}, {'closed' if self._closed else 'open'})"
        )


def open_pool(request: PoolRequest) -> MemcacheHostPool:
    """The pool of ``request`` on a LocalService started from ``request.local_config``;
    ``PoolOpenError`` naming the cause where its data path cannot start (no Ascend driver), the
    wheel is missing or the conf is bad (never the embedded pool instead)."""
    try:
        pool = MemcacheHostPool.connect(request.geometry, local_config=request.local_config, eviction=LRUEviction())
    except (PoolError, MemcacheUnavailable, MemcacheNotInstalled, ValueError) as e:
        raise PoolOpenError(str(e)) from None
    log.info("memcache_pool_connected", meta=pool.client.meta_service_url, pool=repr(pool))
    return pool
