"""``LocalHostPool``: the embedded host KV pool, an in-process object index over a ``SharedSegment``.

It follows the hook map of ``kvcore.pool.host_pool.HostPoolBackend`` (who calls what, what blocks, what
is idempotent). Its state: key -> block id, the planes written per block, the free list, the
blocks pinned by in-flight copies, the lease table (``kvcore.pool.leases``) and an eviction policy
(``kvcore.pool.eviction``; LRU by default).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable, Sequence

import torch

from kvcore.hotcache.gather import scatter_blocks
from kvcore.pool.errors import (
    IncompleteObject,
    ObjectBusy,
    ObjectExists,
    ObjectLeased,
    PoolError,
    PoolFullError,
)
from kvcore.pool.eviction import EvictionPolicy, LRUEviction
from kvcore.pool.geometry import PoolGeometry
from kvcore.pool.host_pool import (
    HostPoolBackend,
    PoolStats,
    _as_block_bytes,
    check_keys,
    check_open_segment,
    check_positive,
    check_same_bytes,
    objects_of,
)
from kvcore.pool.leases import Lease, LeaseTable, LocalLease, check_ttl_ms
from kvcore.pool.segment import SharedSegment


class LocalHostPool(HostPoolBackend):
    """The embedded backend: a ``SharedSegment`` plus an in-process index, free list and policy.

    ``LocalHostPool(segment)`` serves an existing segment and leaves it open on ``close``;
    ``LocalHostPool.create(name, geometry)`` makes its own segment and closes and unlinks it on
    ``close``. Copies run outside the lock; blocks in copy are pinned (never evicted; ``remove``
    waits up to ``io_wait_timeout_s`` for them). Exactly one ``LocalHostPool`` indexes a segment
    (e.g. in the metastore); other processes ``SharedSegment.attach`` it and use the block ids it
    hands out under leases.

    Subclass hooks (``poolbackends.storepool.StoreHostPool``, the Mooncake and Memcache pools, uses
    them; the defaults do nothing):
    ``_before_drop`` and ``_publish``, called with the lock held; ``_grant`` is the lease step of
    ``lease`` without its lookup.
    """

    def __init__(
        self,
        segment: SharedSegment,
        *,
        eviction: EvictionPolicy | None = None,
        io_wait_timeout_s: float = 30.0,
        owns_segment: bool = False,
    ) -> None:
        check_open_segment(segment)
        if eviction is not None and not isinstance(eviction, EvictionPolicy):
            raise ValueError(f"eviction must be an EvictionPolicy, got {type(eviction).__name__}")
        check_positive("io_wait_timeout_s", io_wait_timeout_s)
        g = segment.geometry
        self._segment = segment
        self._owns_segment = owns_segment
        self._policy = eviction if eviction is not None else LRUEviction()
        self._io_wait_timeout_s = io_wait_timeout_s
        self._cond = threading.Condition(threading.Lock())
        self._index: dict[bytes, int] = {}
        self._block_key: list[bytes | None] = [None] * g.num_blocks
        self._written = torch.zeros(g.num_blocks, g.num_planes, dtype=torch.bool)  # [num_blocks, num_planes]
        self._free: list[int] = list(range(g.num_blocks - 1, -1, -1))  # pop() hands out block 0 first
        self._pins: dict[int, int] = {}  # block id -> in-flight copies
        self._leases = LeaseTable()
        self._evictions = 0
        self._closed = False

    @classmethod
    def create(
        cls,
        name: str,
        geometry: PoolGeometry,
        *,
        eviction: EvictionPolicy | None = None,
        replace: bool = False,
        io_wait_timeout_s: float = 30.0,
    ) -> LocalHostPool:
        seg = SharedSegment.create(name, geometry, replace=replace)
        return cls(seg, eviction=eviction, io_wait_timeout_s=io_wait_timeout_s, owns_segment=True)

    @property
    def segment(self) -> SharedSegment:
        return self._segment

    @property
    def geometry(self) -> PoolGeometry:
        return self._segment.geometry

    # ---- internals (call with the lock held) --------------------------------------------------

    def _begin(self) -> None:
        if self._closed:
            raise PoolError("host pool is closed")
        self._leases.expire(time.monotonic())

    def _complete_mask(self, ids: list[int]) -> list[bool]:
        if not ids:
            return []
        return self._written[torch.tensor(ids, dtype=torch.long)].all(1).tolist()

    def _resolve(self, keys: list[bytes], *, plane: int | None = None) -> list[int]:
        """Block ids of existing objects; with ``plane``, that plane must be written too."""
        ids = objects_of(self._index, keys)
        if plane is not None and ids:
            written = self._written[torch.tensor(ids, dtype=torch.long), plane].tolist()
            for k, ok in zip(keys, written):
                if not ok:
                    raise IncompleteObject(f"object {k!r} has no written plane {plane}", key=k)
        return ids

    def _can_evict(self, key: bytes) -> bool:
        bid = self._index.get(key)
        return bid is not None and key not in self._leases and bid not in self._pins and bool(self._written[bid].all())

    def _pin(self, ids: list[int], delta: int) -> None:
        for b in ids:
            c = self._pins.get(b, 0) + delta
            if c:
                self._pins[b] = c
            else:
                del self._pins[b]

    def _drop(self, keys: Iterable[bytes]) -> None:
        ids = []
        for k in keys:
            bid = self._index.pop(k)
            self._block_key[bid] = None
            self._policy.on_remove(k)
            ids.append(bid)
        if ids:
            self._written[torch.tensor(ids, dtype=torch.long)] = False
            self._free.extend(ids)

    def _wait_unpinned(self, keys: list[bytes], deadline: float, what: str) -> bool:
        """Wait (lock held) until no block of ``keys`` is in copy. False if it had to wait (re-check)."""
        busy = next((k for k in keys if self._index.get(k) in self._pins), None)
        if busy is None:
            return True
        left = deadline - time.monotonic()
        if left <= 0:
            raise ObjectBusy(
                f"{what}: a copy of {busy!r} is still in flight after {self._io_wait_timeout_s} s", key=busy
            )
        self._cond.wait(left)
        return False

    def _shortfall_victims(self, n: int, kept: Iterable[bytes] = ()) -> tuple[int, list[bytes]]:
        free = len(self._free)
        if n <= free:
            return free, []
        return free, self._policy.victims(n - free, lambda k: k not in kept and self._can_evict(k))

    def _victims(self, keys: list[bytes]) -> list[bytes]:
        """Victims making room for ``keys`` that ``_before_drop`` let go; ``PoolFullError`` if too few."""
        kept: dict[bytes, str] = {}
        while True:
            free, victims = self._shortfall_victims(len(keys), kept)
            if free + len(victims) < len(keys):
                raise PoolFullError(
                    key=keys[free + len(victims)],
                    needed=len(keys),
                    free=free,
                    evictable=len(victims),
                    num_blocks=self.geometry.num_blocks,
                    policy=type(self._policy).__name__,
                )
            refused = self._before_drop(victims)
            if not refused:
                return victims
            kept.update(refused)

    def _grant(self, keys: list[bytes], ttl_ms: int) -> LocalLease:
        """A lease on ``keys`` for ``ttl_ms`` that counts as a use; the caller checked the keys."""
        record = self._leases.grant(tuple(keys), time.monotonic() + ttl_ms / 1000)
        for k in keys:
            self._policy.on_access(k)
        return LocalLease(record, self._leases, self._cond)

    # ---- subclass hooks (call with the lock held) -----------------------------------------------

    def _before_drop(self, keys: list[bytes]) -> dict[bytes, str]:
        """``keys`` (not leased here, not in copy) are about to be dropped by eviction or ``remove``:
        free what the backend keeps of them elsewhere, all or nothing. Returns ``{key: why}`` for
        keys it must keep (then nothing was freed: eviction picks other victims, ``remove`` raises
        ``ObjectLeased``); may raise a ``PoolError`` (nothing freed). Default: ``{}``."""
        return {}

    def _publish(self, keys: list[bytes], ids: list[int]) -> None:
        """``put_from`` has copied the plane that completes objects ``keys`` (blocks ``ids``) and is
        about to mark it written. Raising aborts: the plane stays unwritten for the whole batch and
        the error reaches the caller. Default: nothing."""

    # ---- engine thread -------------------------------------------------------------------------

    def can_alloc(self, keys: Sequence[bytes]) -> bool:
        keys = check_keys(keys, unique=True)
        with self._cond:
            self._begin()
            if any(k in self._index for k in keys):
                return False
            free, victims = self._shortfall_victims(len(keys))
            return free + len(victims) >= len(keys)

    def alloc(self, keys: Sequence[bytes]) -> list[int]:
        keys = check_keys(keys, unique=True)
        with self._cond:
            self._begin()
            for k in keys:
                if k in self._index:
                    raise ObjectExists(f"key {k!r} already has an object (block {self._index[k]})", key=k)
            victims = self._victims(keys)
            self._drop(victims)
            self._evictions += len(victims)
            ids = [self._free.pop() for _ in keys]
            for k, b in zip(keys, ids):
                self._index[k] = b
                self._block_key[b] = k
            if ids:
                self._written[torch.tensor(ids, dtype=torch.long)] = False
            return ids

    def exists(self, keys: Sequence[bytes]) -> list[bool]:
        keys = check_keys(keys, unique=False)
        with self._cond:
            self._begin()
            ids = torch.tensor([self._index.get(k, -1) for k in keys], dtype=torch.long)  # [n]
            present = ids >= 0
            out = torch.zeros(len(keys), dtype=torch.bool)
            out[present] = self._written[ids[present]].all(1)
            return out.tolist()

    def lease(self, keys: Sequence[bytes], ttl_ms: int) -> Lease:
        keys = check_keys(keys, unique=True)
        check_ttl_ms(ttl_ms)
        with self._cond:
            self._begin()
            self._resolve(keys)
            return self._grant(keys, ttl_ms)

    def remove(self, keys: Sequence[bytes]) -> None:
        keys = check_keys(keys, unique=False)
        deadline = time.monotonic() + self._io_wait_timeout_s
        with self._cond:
            while True:
                self._begin()
                present = [k for k in dict.fromkeys(keys) if k in self._index]
                for k in present:
                    if k in self._leases:
                        raise ObjectLeased(f"cannot remove {k!r}: {self._leases.count(k)} live lease(s)", key=k)
                if self._wait_unpinned(present, deadline, "remove"):
                    break
            refused = self._before_drop(present)
            if refused:
                k = next(iter(refused))
                raise ObjectLeased(f"cannot remove {k!r}: {refused[k]}", key=k)
            self._drop(present)

    def stats(self) -> PoolStats:
        with self._cond:
            self._begin()
            g = self.geometry
            used = g.num_blocks - len(self._free)
            ids = list(self._index.values())
            complete = sum(self._complete_mask(ids))
            return PoolStats(
                num_blocks=g.num_blocks,
                used_blocks=used,
                free_blocks=len(self._free),
                used_bytes=used * g.block_bytes,
                capacity_bytes=g.total_bytes,
                complete_objects=complete,
                live_leases=self._leases.num_live,
                lease_expiries=self._leases.num_expired,
                evictions=self._evictions,
            )

    # ---- transfer threads ----------------------------------------------------------------------

    def put_from(self, keys: Sequence[bytes], plane: int, src: torch.Tensor) -> None:
        keys = check_keys(keys, unique=True)
        plane = self.geometry.check_plane(plane)
        src_u8 = _as_block_bytes(src, "src", len(keys), self.geometry, plane)  # [n, block_size, row_bytes]
        with self._cond:
            self._begin()
            ids = self._resolve(keys)
            if not keys:
                return
            ids_t = torch.tensor(ids, dtype=torch.long)  # [n]
            written = self._written[ids_t, plane].clone()  # [n]; written planes are write-once
            self._pin(ids, +1)
        ok = False
        try:
            dst = self._segment.plane(plane)  # [num_blocks, block_size, row_bytes]
            check_same_bytes(keys, plane, dst, ids_t, written, src_u8)
            fresh = ~written
            if bool(fresh.all()):
                scatter_blocks(dst, ids_t, src_u8)
            elif bool(fresh.any()):
                scatter_blocks(dst, ids_t[fresh], src_u8[fresh])
            ok = True
        finally:
            with self._cond:
                self._pin(ids, -1)
                self._cond.notify_all()
                if ok:
                    after = self._written[ids_t]  # [n, num_planes] (a copy)
                    after[:, plane] = True
                    completes = (after.all(1) & ~self._written[ids_t, plane]).tolist()  # [n]: this write completes
                    self._publish([k for k, c in zip(keys, completes) if c], [b for b, c in zip(ids, completes) if c])
                    self._written[ids_t, plane] = True
                    for k, c in zip(keys, self._complete_mask(ids)):
                        if c:
                            self._policy.on_complete(k)

    def get_into(self, keys: Sequence[bytes], plane: int, dst: torch.Tensor) -> None:
        keys = check_keys(keys, unique=False)
        plane = self.geometry.check_plane(plane)
        dst_u8 = _as_block_bytes(dst, "dst", len(keys), self.geometry, plane)  # [n, block_size, row_bytes]
        with self._cond:
            self._begin()
            ids = self._resolve(keys, plane=plane)
            if not keys:
                return
            for k in keys:
                self._policy.on_access(k)
            self._pin(ids, +1)
        try:
            torch.index_select(self._segment.plane(plane), 0, torch.tensor(ids, dtype=torch.long), out=dst_u8)
        finally:
            with self._cond:
                self._pin(ids, -1)
                self._cond.notify_all()

    def block_ids(self, keys: Sequence[bytes]) -> list[int]:
        keys = check_keys(keys, unique=False)
        with self._cond:
            self._begin()
            return self._resolve(keys)

    def plane(self, p: int) -> torch.Tensor:
        if self._closed:
            raise PoolError("host pool is closed")
        return self._segment.plane(p)

    # ---- lifecycle -----------------------------------------------------------------------------

    def close(self) -> None:
        with self._cond:
            if self._closed:
                return
            self._closed = True
        if self._owns_segment:
            self._segment.close()
            self._segment.unlink()
