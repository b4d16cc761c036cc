"""``MetaStoreCore``: the index of the embedded host pool, shared by every LocalService. No gRPC.

The core holds facts only: registered pools (segment, geometry, last heartbeat), key -> (pool,
block, written planes) (both ``pool_state``), read leases (``leasebook.LeaseBook``, over kvcore's
``LeaseTable``) and one LRU policy per pool (kvcore ``LRUEviction``). It never touches pool bytes:
writers and readers copy them in shared memory at the block ids it hands out. Expiry (leases, then
pools without heartbeats) is evaluated on the injected monotonic ``clock`` at the start of every
call, so there are no timer threads.

Hook map, grouped by caller. Every hook is thread-safe (one lock, held for microseconds; nothing
blocks on I/O), batches are all-or-nothing, and errors are kvcore's pool errors,
``poolbackends.errors``' registry errors and ``PoolFull``.

LocalService (via the servicer, one call per RPC)
------------------------------------------------
``register_pool(pool_id, segment_name, geometry, host, replace)`` -> ``PoolRecord``
    Idempotent for the same segment and geometry. ``WorldSizeExceeded`` beyond ``world_size``.
``heartbeat(pool_id)`` -> ms until expiry. ``PoolNotRegistered`` if unknown or expired.
``deregister_pool(pool_id)`` -> ``(was_registered, dropped_objects, dropped_leases)``. Idempotent.
``pools()`` -> the registered ``PoolRecord``s (segment names to attach).

Writers and readers (prefill / decode engines, via the servicer)
---------------------------------------------------------------
``can_alloc(keys, pool_hint, require_hint)`` / ``check_alloc(...)`` / ``alloc(...)`` -> ``Allocation``
    The checks have no side effects (``check_alloc`` raises what ``alloc`` would); ``alloc``
    evicts LRU complete, unleased objects if needed.
    The caller owns the new (incomplete) objects until complete or removed: never evicted.
``mark_written(keys, plane)`` -> complete flags (``plane`` may be a list: several planes at once). Idempotent.
``lookup(keys)`` / ``exists(keys)``: no side effects (not a use for LRU).
``lease(keys, ttl_ms, holder)`` -> ``LeaseGrant``: the holder releases it or lets it expire after
    ``ttl_ms`` (default ``lease_ttl_ms``); while live, its objects are neither evicted nor removed.
``renew_lease(lease_id, ttl_ms)`` -> (ttl_ms, deadline); ``LeaseExpired`` once it is not live.
``release_lease(lease_id)`` -> whether it was live. Idempotent.
``remove(keys)``: missing keys ignored; ``ObjectLeased`` (nothing removed) if any is leased.

Operators
---------
``stats()`` -> ``MetaStats`` snapshot. ``shutdown()``: release every lease, drop every pool.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence

import structlog

from kvcore.pool.checks import check_count, check_keys, objects_of
from kvcore.pool.errors import ObjectExists, ObjectLeased
from kvcore.pool.geometry import PoolGeometry
from kvcore.pool.segment import SharedSegment
from kvoffload_metastore.errors import PoolFull
from kvoffload_metastore.leasebook import LeaseBook, lease_ttl_ms
from kvoffload_metastore.placement import candidates, check_absent, choose_pool
from kvoffload_metastore.pool_state import PoolState, StoredObject
from kvoffload_metastore.records import Allocation, LeaseGrant, Location, MetaStats, PoolOccupancy, PoolRecord
from poolbackends.errors import NoPoolRegistered, PoolConflict, PoolNotRegistered, WorldSizeExceeded

__all__ = [
    "MetaStoreCore",
    "check_keys",
    "Allocation",
    "LeaseGrant",
    "Location",
    "MetaStats",
    "PoolOccupancy",
    "PoolRecord",
]

log = structlog.get_logger("kvoffload_metastore.core")

MAX_POOL_ID_CHARS = 200
MAX_POOL_BYTES = 2**48  # one pool's segment (block_bytes * num_blocks); world_size of them fit in uint64
MAX_REMEMBERED_EXPIRIES = 1024  # expired pool ids kept for error messages


class MetaStoreCore:
    """The MetaService index (see the module docstring's hook map)."""

    def __init__(
        self,
        *,
        world_size: int = 256,
        lease_ttl_ms: int = 30_000,
        heartbeat_timeout_ms: int = 10_000,
        dram_bytes_per_local_service: int = 0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        for name, value in (
            ("world_size", world_size),
            ("lease_ttl_ms", lease_ttl_ms),
            ("heartbeat_timeout_ms", heartbeat_timeout_ms),
        ):
            check_count(name, value)
        self.world_size = world_size
        self.lease_ttl_ms = lease_ttl_ms
        self.heartbeat_timeout_ms = heartbeat_timeout_ms
        self.dram_bytes_per_local_service = dram_bytes_per_local_service
        self._clock = clock
        self._lock = threading.Lock()
        self._pools: dict[str, PoolState] = {}
        self._objects: dict[bytes, StoredObject] = {}
        self._leases = LeaseBook()
        self._expired_at: dict[str, float] = {}  # pool id -> when it expired (for messages)
        self._pools_expired = 0
        self._evictions = 0

    # ---- internals (lock held) -------------------------------------------------------------------

    def _begin(self) -> float:
        now = self._clock()
        self._leases.table.expire(now)
        deadline = self.heartbeat_timeout_ms / 1000
        for pool in [p for p in self._pools.values() if now - p.last_beat >= deadline]:
            objects, leases = self._drop_pool(pool)
            self._pools_expired += 1
            self._expired_at[pool.record.pool_id] = now
            if len(self._expired_at) > MAX_REMEMBERED_EXPIRIES:
                del self._expired_at[next(iter(self._expired_at))]
            log.warning(
                "pool expired",
                pool_id=pool.record.pool_id,
                heartbeat_timeout_ms=self.heartbeat_timeout_ms,
                dropped_objects=objects,
                dropped_leases=leases,
            )
        return now

    def _pool(self, pool_id: str) -> PoolState:
        pool = self._pools.get(pool_id)
        if pool is None:
            when = self._expired_at.get(pool_id)
            why = (
                f"it expired {self._clock() - when:.1f} s ago after {self.heartbeat_timeout_ms} ms without a "
                f"heartbeat; register it again"
                if when is not None
                else "register it first"
            )
            raise PoolNotRegistered(f"pool {pool_id!r} is not registered: {why}")
        return pool

    def _drop_pool(self, pool: PoolState) -> tuple[int, int]:
        """Drop a pool with its objects and every lease on them; returns (objects, leases)."""
        dropped = self._leases.drop_touching(pool.keys)
        for k in pool.keys:
            del self._objects[k]
        del self._pools[pool.record.pool_id]
        return len(pool.keys), dropped

    def _resolve(self, keys: list[bytes]) -> list[StoredObject]:
        return objects_of(self._objects, keys)

    def _location(self, key: bytes, obj: StoredObject) -> Location:
        return Location(
            key,
            obj.pool.record.pool_id,
            obj.block_id,
            obj.pool.record.block_bytes,
            tuple(sorted(obj.written)),
            obj.complete,
        )

    def _can_evict(self, key: bytes) -> bool:
        obj = self._objects.get(key)
        return obj is not None and obj.complete and key not in self._leases

    def _plan_alloc(
        self, keys: list[bytes], pool_hint: str | None, require_hint: bool
    ) -> tuple[PoolState, list[bytes]]:
        """(pool, victims) for ``keys``, or raise; no side effects (``placement``)."""
        check_absent(self._objects, keys)
        return choose_pool(candidates(self._pools, pool_hint, require_hint, self._pool), keys, self._can_evict)

    # ---- LocalService --------------------------------------------------------------------------

    def register_pool(
        self, pool_id: str, segment_name: str, geometry: PoolGeometry, host: str = "", *, replace: bool = False
    ) -> PoolRecord:
        if not isinstance(pool_id, str) or not 0 < len(pool_id) <= MAX_POOL_ID_CHARS or not pool_id.isprintable():
            raise ValueError(f"pool_id must be 1..{MAX_POOL_ID_CHARS} printable characters, got {pool_id!r:.80}")
        SharedSegment.path_for(segment_name)  # ValueError naming the rule
        if not isinstance(geometry, PoolGeometry):
            raise ValueError(f"geometry must be a PoolGeometry, got {type(geometry).__name__}")
        if geometry.block_bytes * geometry.num_blocks > MAX_POOL_BYTES:  # else Stats' uint64 totals overflow
            raise ValueError(
                f"geometry: {geometry.num_blocks} blocks x {geometry.block_bytes} bytes is more than "
                f"a pool may hold ({MAX_POOL_BYTES} bytes = 256 TiB)"
            )
        record = PoolRecord(pool_id, segment_name, host, geometry)
        with self._lock:
            now = self._begin()
            old = self._pools.get(pool_id)
            if old is not None and not replace:
                if (old.record.segment_name, old.record.geometry) != (segment_name, geometry):
                    raise PoolConflict(
                        f"pool {pool_id!r} is registered with segment {old.record.segment_name!r} "
                        f"and {old.record.geometry}; deregister it or register with replace=true"
                    )
                old.last_beat = now
                return old.record
            if old is not None:
                objects, leases = self._drop_pool(old)
                log.info("pool replaced", pool_id=pool_id, dropped_objects=objects, dropped_leases=leases)
            elif len(self._pools) >= self.world_size:
                raise WorldSizeExceeded(
                    f"cannot register pool {pool_id!r}: world_size={self.world_size} pools are registered "
                    f"({', '.join(sorted(self._pools)[:8])}{', ...' if len(self._pools) > 8 else ''}); raise "
                    f"ock.mmc.local_service.world_size or stop a LocalService"
                )
            self._pools[pool_id] = PoolState(record, last_beat=now)
            self._expired_at.pop(pool_id, None)
            log.info(
                "pool registered",
                pool_id=pool_id,
                segment=segment_name,
                host=host,
                num_blocks=geometry.num_blocks,
                block_bytes=geometry.block_bytes,
            )
            return record

    def heartbeat(self, pool_id: str) -> int:
        """Keep ``pool_id`` alive; returns ms until it expires without another beat."""
        with self._lock:
            now = self._begin()
            self._pool(pool_id).last_beat = now
            return self.heartbeat_timeout_ms

    def deregister_pool(self, pool_id: str) -> tuple[bool, int, int]:
        with self._lock:
            self._begin()
            pool = self._pools.get(pool_id)
            if pool is None:
                return False, 0, 0
            objects, leases = self._drop_pool(pool)
            log.info("pool deregistered", pool_id=pool_id, dropped_objects=objects, dropped_leases=leases)
            return True, objects, leases

    def pools(self) -> list[PoolRecord]:
        with self._lock:
            self._begin()
            return [p.record for p in self._pools.values()]

    # ---- objects -------------------------------------------------------------------------------

    def check_alloc(
        self, keys: Sequence[bytes], pool_hint: str | None = None, require_hint: bool = False
    ) -> tuple[PoolRecord, int]:
        """(pool, evictions) ``alloc`` would use, or the error it would raise; changes nothing."""
        keys = check_keys(keys, unique=True)
        with self._lock:
            self._begin()
            pool, victims = self._plan_alloc(keys, pool_hint, require_hint)
            return pool.record, len(victims)

    def can_alloc(self, keys: Sequence[bytes], pool_hint: str | None = None, require_hint: bool = False) -> bool:
        try:
            self.check_alloc(keys, pool_hint, require_hint)
        except (ObjectExists, PoolFull, NoPoolRegistered, PoolNotRegistered):
            return False
        return True

    def alloc(self, keys: Sequence[bytes], pool_hint: str | None = None, require_hint: bool = False) -> Allocation:
        keys = check_keys(keys, unique=True)
        with self._lock:
            self._begin()
            pool, victims = self._plan_alloc(keys, pool_hint, require_hint)
            for k in victims:
                obj = self._objects.pop(k)
                pool.keys.discard(k)
                pool.policy.on_remove(k)
                pool.recycled.append(obj.block_id)
            pool.evictions += len(victims)
            self._evictions += len(victims)
            ids = []
            for k in keys:
                obj = StoredObject(pool, pool.take_block())
                self._objects[k] = obj
                pool.keys.add(k)
                ids.append(obj.block_id)
            return Allocation(pool.record, ids, len(victims))

    def mark_written(self, keys: Sequence[bytes], plane: int | Sequence[int]) -> list[bool]:
        keys = check_keys(keys, unique=True)
        planes = [plane] if isinstance(plane, int) else list(plane)
        if not planes:
            raise ValueError("mark_written: no plane given")
        with self._lock:
            self._begin()
            objs = self._resolve(keys)
            for k, obj in zip(keys, objs):
                try:
                    for p in planes:
                        obj.pool.record.geometry.check_plane(p)
                except ValueError as e:
                    raise ValueError(f"key {k!r} in pool {obj.pool.record.pool_id!r}: {e}") from None
            out = []
            for k, obj in zip(keys, objs):
                was = obj.complete
                obj.written.update(planes)
                if obj.complete and not was:
                    obj.pool.policy.on_complete(k)
                out.append(obj.complete)
            return out

    def lookup(self, keys: Sequence[bytes]) -> list[Location]:
        keys = check_keys(keys, unique=False)
        with self._lock:
            self._begin()
            return [self._location(k, o) for k, o in zip(keys, self._resolve(keys))]

    def exists(self, keys: Sequence[bytes]) -> list[bool]:
        keys = check_keys(keys, unique=False)
        with self._lock:
            self._begin()
            return [(o := self._objects.get(k)) is not None and o.complete for k in keys]

    def remove(self, keys: Sequence[bytes]) -> int:
        keys = check_keys(keys, unique=False)
        with self._lock:
            self._begin()
            present = [k for k in dict.fromkeys(keys) if k in self._objects]
            for k in present:
                if k in self._leases:
                    raise ObjectLeased(f"cannot remove {k!r}: {self._leases.table.count(k)} live lease(s)", key=k)
            for k in present:
                obj = self._objects.pop(k)
                obj.pool.keys.discard(k)
                obj.pool.policy.on_remove(k)
                obj.pool.recycled.append(obj.block_id)
            return len(present)

    # ---- leases --------------------------------------------------------------------------------

    def lease(self, keys: Sequence[bytes], ttl_ms: int | None = None, holder: str = "") -> LeaseGrant:
        keys = check_keys(keys, unique=True)
        ttl_ms = lease_ttl_ms(ttl_ms, self.lease_ttl_ms)
        with self._lock:
            now = self._begin()
            objs = self._resolve(keys)
            lease_id, lease = self._leases.grant(tuple(keys), now + ttl_ms / 1000)
            for k, obj in zip(keys, objs):
                obj.pool.policy.on_access(k)
            log.debug("lease granted", lease_id=lease_id, keys=len(keys), ttl_ms=ttl_ms, holder=holder)
            return LeaseGrant(lease_id, ttl_ms, lease.deadline, [self._location(k, o) for k, o in zip(keys, objs)])

    def renew_lease(self, lease_id: int, ttl_ms: int | None = None) -> tuple[int, float]:
        """New (ttl_ms, deadline) of a live lease; ``LeaseExpired`` otherwise."""
        ttl_ms = lease_ttl_ms(ttl_ms, self.lease_ttl_ms)
        with self._lock:
            now = self._begin()
            return ttl_ms, self._leases.renew(lease_id, now + ttl_ms / 1000)

    def release_lease(self, lease_id: int) -> bool:
        """Release a lease; False if it was not live. Idempotent."""
        with self._lock:
            self._begin()
            return self._leases.release(lease_id)

    # ---- operators -----------------------------------------------------------------------------

    def stats(self) -> MetaStats:
        with self._lock:
            now = self._begin()
            pools = [
                PoolOccupancy(
                    p.record,
                    p.record.geometry.num_blocks - p.free_blocks,
                    len(p.keys),
                    sum(self._objects[k].complete for k in p.keys),
                    p.evictions,
                    int((now - p.last_beat) * 1000),
                )
                for p in self._pools.values()
            ]
            return MetaStats(
                pools,
                self.world_size,
                self.lease_ttl_ms,
                self.heartbeat_timeout_ms,
                self.dram_bytes_per_local_service,
                self._leases.table.num_live,
                self._leases.table.num_expired,
                self._leases.dropped,
                self._evictions,
                self._pools_expired,
            )

    def shutdown(self) -> tuple[int, int]:
        """Release every lease and drop every pool (after the server stopped); returns (pools, leases)."""
        with self._lock:
            leases = self._leases.release_all()
            pools = len(self._pools)
            self._pools.clear()
            self._objects.clear()
            return pools, leases
