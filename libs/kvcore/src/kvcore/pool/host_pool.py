"""The host KV pool's interface: ``HostPoolBackend``, its hook map, and the checks every backend applies.

An *object* is one block of ``block_size`` tokens over every *plane* (one plane per cache per
layer: layer i main KV, layer i indexer keys, ...), keyed by ``bytes`` (``kvcore.pool.block_keys``).
``HostPoolBackend`` is the narrow object-store interface (shaped like memcache_hybrid / Mooncake
Store) that callers use, with the checks every backend applies to its arguments (``check_keys``,
``_as_block_bytes``, ``check_open_segment``, ``check_positive``, ``check_count``), the lookup of keys
in an index (``objects_of``) and the write-once rule (``check_same_bytes``). ``LocalHostPool``
(``kvcore.pool.local``) is the embedded backend over a ``SharedSegment``. A distributed backend
replaces it without touching callers. Eviction policy is a separate object. Elsewhere:
``PoolGeometry`` in ``kvcore.pool.geometry``, ``SharedSegment`` in ``kvcore.pool.segment``, the
``Lease`` protocol and the lease table in ``kvcore.pool.leases``, the errors in ``kvcore.pool.errors``,
the eviction policies in ``kvcore.pool.eviction``.

Hook map of ``HostPoolBackend``, grouped by caller. All methods are thread-safe; lists are
batches and every batch is all-or-nothing (on error nothing changed). "Blocks" means waits on
other threads: ``LocalHostPool`` never waits on the network or on another process;
``poolbackends.remotepool.RemoteHostPool`` also makes bounded calls to the metastore (its timeout).

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
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from kvcore.pool.checks import MAX_KEY_BYTES, check_count, check_keys, check_positive, objects_of  # noqa: F401
from kvcore.pool.errors import (  # noqa: F401 - the pool's error vocabulary, importable from here
    IncompleteObject,
    LeaseExpired,
    ObjectBusy,
    ObjectExists,
    ObjectLeased,
    ObjectNotFound,
    ObjectUnreachable,
    PlaneWritten,
    PoolError,
    PoolFullError,
)
from kvcore.pool.geometry import PoolGeometry
from kvcore.pool.leases import Lease
from kvcore.pool.segment import SharedSegment

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

    def __enter__(self) -> HostPoolBackend:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def check_open_segment(segment: object) -> None:
    """ValueError unless ``segment`` is an open ``SharedSegment`` (what a pool's memory must be)."""
    if not isinstance(segment, SharedSegment) or segment.closed:
        raise ValueError("segment must be an open SharedSegment")


def _as_block_bytes(t: torch.Tensor, name: str, n: int, geometry: PoolGeometry, plane: int) -> torch.Tensor:
    """``t [n, block_size, ...]`` (CPU, contiguous) -> uint8 view ``[n, block_size, row_bytes]``."""
    row_bytes = geometry.plane_row_bytes[plane]
    want = f"[{n}, {geometry.block_size}, {row_bytes} bytes per row] (plane {plane})"
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor {want}, got {type(t).__name__}")
    if t.device.type != "cpu":
        raise ValueError(f"{name} must be on CPU, got {t.device}; stage device data through a host buffer")
    if (
        t.dim() < 2
        or tuple(t.shape[:2]) != (n, geometry.block_size)
        or math.prod(t.shape[2:]) * t.element_size() != row_bytes
    ):
        raise ValueError(f"{name} must be {want}, got shape {tuple(t.shape)} of {t.dtype}")
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous; call .contiguous() first")
    return t.view(torch.uint8).view(n, geometry.block_size, row_bytes)


def check_same_bytes(
    keys: Sequence[bytes], plane: int, dst: torch.Tensor, ids: torch.Tensor, written: torch.Tensor, src: torch.Tensor
) -> None:
    """The write-once rule of ``put_from``: each already ``written`` object (``ids [n]`` into
    ``dst [num_blocks, block_size, row_bytes]``) must hold ``src [n, block_size, row_bytes]``
    already, else ``PlaneWritten`` naming the first key that differs."""
    if not bool(written.any()):
        return
    same = (dst[ids[written]] == src[written]).flatten(1).all(1)  # [n_written]
    if not bool(same.all()):
        k = [k for k, w in zip(keys, written.tolist()) if w][int((~same).nonzero()[0])]
        raise PlaneWritten(
            f"cannot write plane {plane} of {k!r} with other bytes: a written plane is write-once "
            f"(readers may hold its block id); remove the object and alloc it again",
            key=k,
        )
