"""The host KV pool: a shared-memory segment of blocks plus an object index.

An *object* is one block of ``block_size`` tokens over every *plane* (one plane per cache per
layer: layer i main KV, layer i indexer keys, ...), keyed by ``bytes`` (``kvcore.blockkeys``).
``HostPoolBackend`` is the narrow object-store interface (shaped like memcache_hybrid / Mooncake
Store) that callers use; ``LocalHostPool`` is the embedded backend over a ``SharedSegment``. A
distributed backend replaces it without touching callers. Eviction policy is a separate object.
Elsewhere: ``PoolGeometry`` and ``SharedSegment`` in ``kvcore.segment``, the ``Lease`` protocol
and the lease table in ``kvcore.leases``, the errors in ``kvcore.poolerrors``, the eviction
policies in ``kvcore.eviction``.

Hook map of ``HostPoolBackend``, grouped by caller. All methods are thread-safe; lists are
batches and every batch is all-or-nothing (on error nothing changed). "Blocks" means waits on
other threads: ``LocalHostPool`` never waits on the network or on another process;
``poolclient.remotepool.RemoteHostPool`` also makes bounded calls to the metastore (its timeout).

Engine thread (scheduler / step loop; the metastore servicer calls the same hooks for remote
processes, one call per RPC)
------------------------------------------------------------------------------------------
``can_alloc(keys)``
    Side-effect-free admission check: would ``alloc(keys)`` succeed now (counting evictions)?
    Blocks: only on the pool lock (microseconds). Idempotent: yes. Must not touch: any state.
``alloc(keys)``
    Reserve one block per new key (evicting if the policy allows). Returns block ids; the caller
    owns the incomplete objects until it writes every plane or calls ``remove``: incomplete
    objects are never evicted, so a crashed writer must be cleaned up with ``remove``.
    Blocks: lock only. Idempotent: no (an existing key raises ``ObjectExists``). Must not touch:
    leased, incomplete, or in-copy objects (never chosen as victims).
``exists(keys)``
    True per key only for complete objects (every plane written, no write in progress).
    Blocks: lock only. Idempotent: yes. Must not touch: eviction order (a probe is not a use).
``lease(keys, ttl_ms)``
    Lease on existing objects (complete, or incomplete ones a writer pins while it fills them);
    returns a ``Lease`` the caller must ``release()`` (or let expire: after ``deadline`` it stops
    protecting, and the objects may be evicted). While live, the objects are neither evicted nor
    removed (unwritten planes may still be written: a writer pins what it fills). Blocks: lock
    only. Idempotent: no (each call is a new lease). Must not touch: objects' bytes.
``remove(keys)``
    Free objects (complete or not). Missing keys are ignored, so cleanup after a fault may
    repeat it. A leased key raises ``ObjectLeased`` and nothing is removed. Blocks: until
    in-flight copies of those keys finish (bounded by ``io_wait_timeout_s``, then
    ``ObjectBusy``). Idempotent: yes. Must not touch: leased objects.
``stats()``
    A ``PoolStats`` snapshot. Blocks: lock only. Idempotent: yes. Must not touch: any state
    (it only applies due lease expiries, as every hook does).

Transfer threads (save / load / remote pull)
--------------------------------------------
``put_from(keys, plane, src)``
    Copy ``src [len(keys), block_size, row_bytes]`` (CPU, contiguous, any dtype) into ``plane``
    of each allocated object; the plane counts as written once the copy finishes. While copying,
    the object reads as incomplete. A written plane is write-once, in every backend: the same
    bytes again are a no-op, other bytes raise ``PlaneWritten`` (nothing is written). Blocks: for
    the copy (not under the lock). Idempotent: yes (same bytes, same result). Must not touch: a
    written plane (readers in this or other processes may hold its block id under a lease).
    Several planes of the same objects (a layer's main KV and indexer keys):
    ``put_planes_from(keys, {plane: src})``, a concrete method that calls ``put_from`` per plane
    in plane order; a backend may override it to save round trips (``RemoteHostPool``: one copy
    lease and one MarkWritten for all of them).
``get_into(keys, plane, dst)``
    Copy ``plane`` of objects whose ``plane`` is written into ``dst`` (same shape rules); the
    other planes may still be in progress (a layerwise writer reads back its own earlier layers).
    Counts as a use for LRU. Blocks: for the copy (not under the lock). Idempotent: yes. Must
    not touch: objects whose plane is unwritten (``IncompleteObject``) or missing ones
    (``ObjectNotFound``). A distributed backend that lists an object whose owner is gone raises
    ``ObjectUnreachable`` and removes it (the caller may compute it again).
``block_ids(keys)``
    Block id of each allocated object, for block tables of native gather/scatter over
    ``plane(p)``. The ids stay valid only while the caller holds a lease (complete objects) or
    owns the object (incomplete ones). Blocks: lock only. Idempotent: yes. Must not touch: state.
``plane(p)``
    uint8 view ``[num_blocks, block_size, row_bytes_p]`` of the shared memory. Blocks: no.
    Idempotent: yes. Must not touch: blocks the caller neither leases nor owns; direct writes
    bypass the written-plane bookkeeping (use ``put_from`` to complete objects).

Lifecycle (whoever built the pool)
----------------------------------
``geometry``
    The ``PoolGeometry`` (property). Blocks: no. Idempotent: yes. Must not touch: state.
``close()``
    Stop serving; release the segment if the pool owns it. Blocks: lock only. Idempotent: yes.
    Must not touch: a segment it does not own (others may still map it).
"""

from __future__ import annotations

import math
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import torch

from kvcore.eviction import EvictionPolicy, LRUEviction
from kvcore.leases import Lease, LeaseTable, LocalLease, check_ttl_ms
from kvcore.poolerrors import (  # noqa: F401 - the pool's error vocabulary, importable from here
    IncompleteObject,
    LeaseExpired,
    ObjectBusy,
    ObjectExists,
    ObjectLeased,
    ObjectNotFound,
    ObjectUnreachable,
    PoolError,
    PlaneWritten,
    PoolFullError,
)
from kvcore.segment import PoolGeometry, SharedSegment

MAX_KEY_BYTES = 512


# --------------------------------------------------------------------------------------------
# Stats
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PoolStats:
    num_blocks: int
    used_blocks: int
    free_blocks: int
    used_bytes: int
    capacity_bytes: int
    complete_objects: int
    live_leases: int
    lease_expiries: int
    evictions: int


# --------------------------------------------------------------------------------------------
# Backend interface
# --------------------------------------------------------------------------------------------


class HostPoolBackend(ABC):
    """Narrow object-store interface of the host KV pool (see the module docstring's hook map)."""

    @property
    @abstractmethod
    def geometry(self) -> PoolGeometry: ...

    @abstractmethod
    def can_alloc(self, keys: Sequence[bytes]) -> bool: ...

    @abstractmethod
    def alloc(self, keys: Sequence[bytes]) -> list[int]: ...

    @abstractmethod
    def put_from(self, keys: Sequence[bytes], plane: int, src: torch.Tensor) -> None: ...

    def put_planes_from(self, keys: Sequence[bytes], srcs: Mapping[int, torch.Tensor]) -> None:
        """``put_from(keys, plane, src)`` for each ``plane -> src`` of ``srcs``, in plane order."""
        for plane in sorted(srcs):
            self.put_from(keys, plane, srcs[plane])

    @abstractmethod
    def get_into(self, keys: Sequence[bytes], plane: int, dst: torch.Tensor) -> None: ...

    @abstractmethod
    def exists(self, keys: Sequence[bytes]) -> list[bool]: ...

    @abstractmethod
    def lease(self, keys: Sequence[bytes], ttl_ms: int) -> Lease: ...

    @abstractmethod
    def remove(self, keys: Sequence[bytes]) -> None: ...

    @abstractmethod
    def block_ids(self, keys: Sequence[bytes]) -> list[int]: ...

    @abstractmethod
    def plane(self, p: int) -> torch.Tensor: ...

    @abstractmethod
    def stats(self) -> PoolStats: ...

    @abstractmethod
    def close(self) -> None: ...

    def __enter__(self) -> "HostPoolBackend":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def check_keys(keys: Sequence[bytes], *, unique: bool) -> list[bytes]:
    """``keys`` as a list of 1..MAX_KEY_BYTES bytes keys (unique if asked), else ValueError."""
    if isinstance(keys, (bytes, bytearray, str)) or not isinstance(keys, Sequence):
        raise ValueError(f"keys must be a list of bytes keys, got {type(keys).__name__}")
    keys = list(keys)
    for i, k in enumerate(keys):
        if not isinstance(k, bytes) or not 0 < len(k) <= MAX_KEY_BYTES:
            raise ValueError(f"keys[{i}] must be bytes of length 1..{MAX_KEY_BYTES}, got {k!r:.80}")
    if unique and len(set(keys)) != len(keys):
        dup = next(k for i, k in enumerate(keys) if k in keys[:i])
        raise ValueError(f"keys must be unique in one call; {dup!r} repeats")
    return keys


def _as_block_bytes(t: torch.Tensor, name: str, n: int, geometry: PoolGeometry, plane: int) -> torch.Tensor:
    """``t [n, block_size, ...]`` (CPU, contiguous) -> uint8 view ``[n, block_size, row_bytes]``."""
    row_bytes = geometry.plane_row_bytes[plane]
    want = f"[{n}, {geometry.block_size}, {row_bytes} bytes per row] (plane {plane})"
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor {want}, got {type(t).__name__}")
    if t.device.type != "cpu":
        raise ValueError(f"{name} must be on CPU, got {t.device}; stage device data through a host buffer")
    if t.dim() < 2 or tuple(t.shape[:2]) != (n, geometry.block_size) or \
            math.prod(t.shape[2:]) * t.element_size() != row_bytes:
        raise ValueError(f"{name} must be {want}, got shape {tuple(t.shape)} of {t.dtype}")
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous; call .contiguous() first")
    return t.view(torch.uint8).view(n, geometry.block_size, row_bytes)


def check_same_bytes(keys: Sequence[bytes], plane: int, dst: torch.Tensor, ids: torch.Tensor,
                     written: torch.Tensor, src: torch.Tensor) -> None:
    """The write-once rule of ``put_from``: each already ``written`` object (``ids [n]`` into
    ``dst [num_blocks, block_size, row_bytes]``) must hold ``src [n, block_size, row_bytes]``
    already, else ``PlaneWritten`` naming the first key that differs."""
    if not bool(written.any()):
        return
    same = (dst[ids[written]] == src[written]).flatten(1).all(1)  # [n_written]
    if not bool(same.all()):
        k = [k for k, w in zip(keys, written.tolist()) if w][int((~same).nonzero()[0])]
        raise PlaneWritten(f"cannot write plane {plane} of {k!r} with other bytes: a written plane is write-once "
                           f"(readers may hold its block id); remove the object and alloc it again", key=k)


# --------------------------------------------------------------------------------------------
# Embedded backend
# --------------------------------------------------------------------------------------------


class LocalHostPool(HostPoolBackend):
    """The embedded backend: a ``SharedSegment`` plus an in-process index, free list and policy.

    ``LocalHostPool(segment)`` serves an existing segment and leaves it open on ``close``;
    ``LocalHostPool.create(name, geometry)`` makes its own segment and closes and unlinks it on
    ``close``. Copies run outside the lock; blocks in copy are pinned (never evicted; ``remove``
    waits up to ``io_wait_timeout_s`` for them). Exactly one ``LocalHostPool`` indexes a segment
    (e.g. in the metastore); other processes ``SharedSegment.attach`` it and use the block ids it
    hands out under leases.

    Subclass hooks (``poolclient.storepool.StoreHostPool``, the Mooncake and Memcache pools, uses
    them; the defaults do nothing):
    ``_before_drop`` and ``_publish``, called with the lock held; ``_grant`` is the lease step of
    ``lease`` without its lookup.
    """

    def __init__(self, segment: SharedSegment, *, eviction: EvictionPolicy | None = None,
                 io_wait_timeout_s: float = 30.0, owns_segment: bool = False) -> None:
        if not isinstance(segment, SharedSegment) or segment.closed:
            raise ValueError("segment must be an open SharedSegment")
        if eviction is not None and not isinstance(eviction, EvictionPolicy):
            raise ValueError(f"eviction must be an EvictionPolicy, got {type(eviction).__name__}")
        if not io_wait_timeout_s > 0:
            raise ValueError(f"io_wait_timeout_s must be > 0, got {io_wait_timeout_s}")
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
    def create(cls, name: str, geometry: PoolGeometry, *, eviction: EvictionPolicy | None = None,
               replace: bool = False, io_wait_timeout_s: float = 30.0) -> "LocalHostPool":
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
        ids = []
        for k in keys:
            bid = self._index.get(k)
            if bid is None:
                raise ObjectNotFound(f"no object for key {k!r}", key=k)
            ids.append(bid)
        if plane is not None and ids:
            written = self._written[torch.tensor(ids, dtype=torch.long), plane].tolist()
            for k, ok in zip(keys, written):
                if not ok:
                    raise IncompleteObject(f"object {k!r} has no written plane {plane}", key=k)
        return ids

    def _can_evict(self, key: bytes) -> bool:
        bid = self._index.get(key)
        return bid is not None and key not in self._leases and bid not in self._pins \
            and bool(self._written[bid].all())

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
            raise ObjectBusy(f"{what}: a copy of {busy!r} is still in flight after {self._io_wait_timeout_s} s",
                             key=busy)
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
                raise PoolFullError(key=keys[free + len(victims)], needed=len(keys), free=free,
                                    evictable=len(victims), num_blocks=self.geometry.num_blocks,
                                    policy=type(self._policy).__name__)
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
                num_blocks=g.num_blocks, used_blocks=used, free_blocks=len(self._free),
                used_bytes=used * g.block_bytes, capacity_bytes=g.total_bytes, complete_objects=complete,
                live_leases=self._leases.num_live, lease_expiries=self._leases.num_expired,
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
                dst.index_copy_(0, ids_t, src_u8)
            elif bool(fresh.any()):
                dst.index_copy_(0, ids_t[fresh], src_u8[fresh])
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
