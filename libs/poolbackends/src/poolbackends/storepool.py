"""``StoreHostPool``: the base of host pools whose complete objects are shared through an existing
distributed store (``poolbackends.mooncake.MooncakeHostPool`` over Mooncake Store,
``poolbackends.memcache.MemcacheHostPool`` over Memcache).

Where bytes live. A ``StoreHostPool`` is a ``kvcore.pool.local.LocalHostPool`` over a
``SharedSegment`` of its own (``/dev/shm/kvoffload-<prefix>-<pool id>``, created here, closed and
unlinked on ``close``); its index, free list, written planes, pins, leases, eviction and stats are
``LocalHostPool``'s. The store is the shared layer: when ``put_from`` writes an object's last
plane, ``_publish`` puts the whole object to the store (key ``<namespace>/<key hex>``), under the
lock; a failed put leaves the plane unwritten. This pool's own objects are answered locally.

Keys held only in the store. Each batch is split into keys held here and keys held only in the
store: ``exists`` / ``lease`` / ``get_into`` / ``can_alloc`` ask the store for the latter;
a load reads each such object whole once and keeps it for its other planes (``store_fetched``);
``alloc`` of a key complete in the store raises ``ObjectExists`` (written once, across pools);
``block_ids`` of it raises ``PoolError`` (``plane(p)`` views only this pool); ``remove`` of it is
ignored. The pool that allocated an object owns it: its eviction, ``remove`` and ``close`` remove
the store copy too, all or nothing (``_before_drop``).

Subclasses implement the store primitives, each one bounded batch of store calls (``STORE`` names
the store in messages): ``_attach(segment)`` (register the segment with the store; called once
from ``__init__``), ``_store_put(keys, ids)`` (all or none, else a ``PoolError``),
``_store_remove(keys)`` (all or nothing: ``{key: why}`` for copies the store keeps, having put back
those it removed), ``_store_exists(keys, op)``, ``_store_read(keys, staging)`` (whole objects into
rows of a ``[len(keys), block_bytes]`` uint8 tensor; ``ObjectNotFound`` for a missing key),
``_store_lease(keys, ttl_ms)`` (the store's own read lease; which keys it holds),
``_store_remove_all(keys)`` (the pool is closing) and ``_detach()`` (unregister, close an owned
client).
"""

from __future__ import annotations

import threading
import uuid
from abc import abstractmethod
from collections.abc import Callable, Sequence
from typing import Protocol, TypeVar

import structlog
import torch

from kvcore.pool.eviction import EvictionPolicy
from kvcore.pool.geometry import PoolGeometry
from kvcore.pool.host_pool import ObjectExists, ObjectNotFound, PoolError, _as_block_bytes, check_keys
from kvcore.pool.leases import Lease, check_ttl_ms
from kvcore.pool.local import LocalHostPool
from kvcore.pool.segment import SharedSegment
from poolbackends.store_fetched import FetchedObjects

log = structlog.get_logger(__name__)


class _Closable(Protocol):
    def close(self) -> None: ...


_Pool = TypeVar("_Pool")


def owning(resource: _Closable, build: Callable[[], _Pool]) -> _Pool:
    """``build()``: a pool that owns ``resource`` (its store client); if building fails, the resource
    is closed before the error propagates (nothing else would close it)."""
    try:
        return build()
    except BaseException:
        resource.close()
        raise


def store_bytes_for(geometry: PoolGeometry) -> int:
    """Store memory that holds every object of ``geometry`` (allocator slack included), whole MiB."""
    return ((geometry.num_blocks * geometry.block_bytes * 9 // 8 + (16 << 20)) >> 20) << 20


class StoreHostPool(LocalHostPool):
    """A ``LocalHostPool`` whose objects are shared through a store (see the module docstring)."""

    STORE = "the store"  # the store's name in messages

    def __init__(
        self,
        geometry: PoolGeometry,
        *,
        prefix: str,
        namespace: str,
        eviction: EvictionPolicy | None,
        io_wait_timeout_s: float,
    ) -> None:
        if not isinstance(namespace, str) or not namespace or "/" in namespace:
            raise ValueError(f"namespace must be a non-empty str without '/', got {namespace!r}")
        self.pool_id = uuid.uuid4().hex
        self.namespace = namespace
        segment = SharedSegment.create(f"{prefix}-{self.pool_id}", geometry)  # ValueError for a bad geometry
        try:
            super().__init__(segment, eviction=eviction, io_wait_timeout_s=io_wait_timeout_s, owns_segment=True)
            self._part_bytes = [geometry.block_size * rb for rb in geometry.plane_row_bytes]  # per object, per plane
            self._published = torch.zeros(geometry.num_blocks, dtype=torch.bool)  # [num_blocks]: store copy there
            self._closing = threading.Event()  # set first thing in close: no object is published after it
            self._fetched = FetchedObjects(geometry.num_planes, geometry.num_blocks * geometry.block_bytes)
            self._attach(segment)
        except BaseException:
            segment.close()
            segment.unlink()
            raise

    # ---- the store primitives (subclasses) -----------------------------------------------------

    @abstractmethod
    def _attach(self, segment: SharedSegment) -> None:
        """Register the pool's segment with the store client."""

    @abstractmethod
    def _store_put(self, keys: list[bytes], ids: list[int]) -> None:
        """Put the complete objects ``keys`` (blocks ``ids``) to the store, all or none."""

    @abstractmethod
    def _store_remove(self, keys: list[bytes]) -> dict[bytes, str]:
        """Remove the store copies of ``keys``, all or nothing; ``{key: why}`` for copies the store keeps."""

    @abstractmethod
    def _store_exists(self, keys: list[bytes], op: str) -> list[bool]:
        """Per key: complete in the store (``op`` names the caller in errors)."""

    @abstractmethod
    def _store_read(self, keys: list[bytes], staging: torch.Tensor) -> None:
        """Read whole objects ``keys`` from the store into ``staging``."""

    @abstractmethod
    def _store_lease(self, keys: list[bytes], ttl_ms: int) -> list[bool]:
        """Take the store's own lease on ``keys`` for ``ttl_ms``; per key, whether it exists."""

    @abstractmethod
    def _store_remove_all(self, keys: list[bytes]) -> None:
        """Remove the store copies of ``keys`` on close (best effort, logged)."""

    @abstractmethod
    def _detach(self) -> None:
        """Unregister the segment; close a client the pool owns."""

    def _halt(self) -> None:
        """First step of ``close`` (after ``_closing`` is set): stop background work. Default: nothing."""

    # ---- LocalHostPool's hooks (called with the lock held) -------------------------------------

    def _ids(self, keys: list[bytes]) -> torch.Tensor:
        return torch.tensor([self._index[k] for k in keys], dtype=torch.long)

    def _published_of(self, keys: list[bytes]) -> list[bytes]:
        if not keys:
            return []
        return [k for k, f in zip(keys, self._published[self._ids(keys)].tolist()) if f]

    def _before_drop(self, keys: list[bytes]) -> dict[bytes, str]:
        """Remove the store copies of ``keys``, all or nothing (``_store_remove``)."""
        mine = self._published_of(keys)
        refused = self._store_remove(mine)
        if not refused and mine:
            self._published[self._ids(mine)] = False
        return refused

    def _publish(self, keys: list[bytes], ids: list[int]) -> None:
        """Put the objects this ``put_from`` completes to the store, all or none (else it raises)."""
        if keys and self._closing.is_set():
            raise PoolError("host pool is closing")
        self._store_put(keys, ids)
        if ids:
            self._published[torch.tensor(ids, dtype=torch.long)] = True

    # ---- keys this pool does not hold: ask the store -------------------------------------------

    def _others(self, keys: list[bytes]) -> list[bytes]:
        """The distinct keys of ``keys`` this pool does not hold."""
        with self._cond:
            self._begin()
            return list(dict.fromkeys(k for k in keys if k not in self._index))

    def _in_store(self, keys: list[bytes], op: str) -> list[bool]:
        """Per key: not in this pool, and complete in the store (``op`` names the caller)."""
        others = self._others(keys)
        found = {k for k, ok in zip(others, self._store_exists(others, op) if others else []) if ok}
        return [k in found for k in keys]

    def can_alloc(self, keys: Sequence[bytes]) -> bool:
        keys = check_keys(keys, unique=True)
        return not any(self._in_store(keys, "can_alloc")) and super().can_alloc(keys)

    def alloc(self, keys: Sequence[bytes]) -> list[int]:
        keys = check_keys(keys, unique=True)
        for k, there in zip(keys, self._in_store(keys, "alloc")):
            if there:
                raise ObjectExists(
                    f"key {k!r} already has an object in {self.STORE} (namespace "
                    f"{self.namespace!r}): another pool wrote it",
                    key=k,
                )
        return super().alloc(keys)

    def exists(self, keys: Sequence[bytes]) -> list[bool]:
        here = super().exists(keys)
        return [h or s for h, s in zip(here, self._in_store(list(keys), "exists"))]

    def lease(self, keys: Sequence[bytes], ttl_ms: int) -> Lease:
        keys = check_keys(keys, unique=True)
        check_ttl_ms(ttl_ms)
        others = self._others(keys)
        held = {k for k, ok in zip(others, self._store_lease(others, ttl_ms) if others else []) if ok}
        with self._cond:
            self._begin()
            for k in keys:
                if k not in held and k not in self._index:  # never here, or removed or evicted meanwhile
                    raise ObjectNotFound(f"no object for key {k!r} in this pool or in {self.STORE}", key=k)
            return self._grant(keys, ttl_ms)

    def get_into(self, keys: Sequence[bytes], plane: int, dst: torch.Tensor) -> None:
        keys = check_keys(keys, unique=False)
        with self._cond:
            self._begin()
            local = [k in self._index for k in keys]
        if all(local):
            return super().get_into(keys, plane, dst)
        g = self.geometry
        plane = g.check_plane(plane)
        dst_u8 = _as_block_bytes(dst, "dst", len(keys), g, plane)  # [n, block_size, row_bytes]
        local_t = torch.tensor(local, dtype=torch.bool)  # [n]
        mine = torch.empty(int(local_t.sum()), g.block_size, g.plane_row_bytes[plane], dtype=torch.uint8)
        super().get_into([k for k, loc in zip(keys, local) if loc], plane, mine)
        fetched = self._fetch([k for k, loc in zip(keys, local) if not loc], plane)
        dst_u8[local_t] = mine
        dst_u8[~local_t] = fetched

    def _fetch(self, keys: list[bytes], plane: int) -> torch.Tensor:
        """Plane ``plane`` of objects read from the store: ``[len(keys), block_size, row_bytes]``. An
        object is fetched whole once per load: kept for its other planes (``FetchedObjects``), each
        kept one checked to be in the store still (one ``exists``, not a fetch)."""
        g = self.geometry
        uniq = list(dict.fromkeys(keys))
        whole = self._fetched.take(uniq, plane)  # key -> [block_bytes], when every one is kept
        if whole is not None and not all(self._store_exists(uniq, "get_into")):
            whole = None  # a kept copy is the store's bytes, but an object removed since is not read
        if whole is None:
            staging = torch.empty(len(uniq), g.block_bytes, dtype=torch.uint8)  # [m, block_bytes]
            self._store_read(uniq, staging)
            self._fetched.keep(uniq, staging, plane)
            whole = dict(zip(uniq, staging, strict=True))
        off = sum(self._part_bytes[:plane])
        part = torch.stack([whole[k][off : off + self._part_bytes[plane]] for k in keys])  # the plane's bytes only
        return part.reshape(len(keys), g.block_size, g.plane_row_bytes[plane])

    def block_ids(self, keys: Sequence[bytes]) -> list[int]:
        try:
            return super().block_ids(keys)
        except ObjectNotFound as e:
            if e.key is not None and self._store_exists([e.key], "block_ids")[0]:
                raise PoolError(
                    f"block_ids: object {e.key!r} is held in {self.STORE} by another pool, and "
                    f"plane(p) views only this pool: read it with get_into",
                    key=e.key,
                ) from None
            raise

    # ---- lifecycle -------------------------------------------------------------------------------

    def close(self) -> None:
        """Stop background work, remove this pool's store copies, detach from the store (closing the
        client it owns) and release the segment. Idempotent."""
        self._closing.set()  # from here no object is published (see _publish)
        self._halt()
        with self._cond:
            if self._closed:
                return
            mine = self._published_of(list(self._index))
        try:
            self._store_remove_all(mine)
        except PoolError as e:
            log.warning("store_pool_close_remove_failed", store=self.STORE, pool=self.pool_id[:8], error=str(e))
        self._detach()
        super().close()
        log.info("store_pool_closed", store=self.STORE, pool=self.pool_id[:8], namespace=self.namespace)
