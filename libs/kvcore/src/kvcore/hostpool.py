"""The host KV pool: a shared-memory segment of blocks plus an object index.

An *object* is one block of ``block_size`` tokens over every *plane* (one plane per cache per
layer: layer i main KV, layer i indexer keys, ...), keyed by ``bytes`` (``kvcore.blockkeys``).
``HostPoolBackend`` is the narrow object-store interface (shaped like memcache_hybrid / Mooncake
Store) that callers use; ``LocalHostPool`` is the embedded backend over a ``SharedSegment``. A
distributed backend replaces it without touching callers. Eviction policy is a separate object.

Hook map of ``HostPoolBackend``, grouped by caller. All methods are thread-safe; lists are
batches and every batch is all-or-nothing (on error nothing changed). "Blocks" means waits on
other threads; no method waits on the network or on another process.

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
    Read lease on complete objects; returns a ``Lease`` the caller must ``release()`` (or let
    expire: after ``deadline`` it stops protecting, and the objects may be evicted). While live,
    the objects are neither evicted nor removed nor rewritten. Blocks: lock only. Idempotent: no
    (each call is a new lease). Must not touch: objects' bytes.
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
    the object reads as incomplete. Blocks: for the copy (not under the lock), and first until
    readers' in-flight copies of a complete object finish. Idempotent: yes (same bytes, same
    result). Must not touch: leased objects (``ObjectLeased``).
``get_into(keys, plane, dst)``
    Copy ``plane`` of complete objects into ``dst`` (same shape rules). Counts as a use for LRU.
    Blocks: for the copy (not under the lock). Idempotent: yes. Must not touch: incomplete
    objects (``IncompleteObject``) or missing ones (``ObjectNotFound``).
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

import heapq
import itertools
import json
import math
import mmap
import os
import re
import struct
import threading
import time
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import torch

from kvcore.layout import KVLayout

PLANE_KINDS = ("main", "indexer")
MAX_KEY_BYTES = 512


# --------------------------------------------------------------------------------------------
# Errors
# --------------------------------------------------------------------------------------------


class PoolError(RuntimeError):
    """Base of host-pool failures; ``key`` is the first offending key (None if not about one)."""

    def __init__(self, message: str, *, key: bytes | None = None) -> None:
        super().__init__(message)
        self.key = key


class ObjectNotFound(PoolError):
    """The key has no object (never allocated, removed, or evicted)."""


class IncompleteObject(PoolError):
    """The object exists but not every plane is written (or a write is in progress)."""


class ObjectExists(PoolError):
    """``alloc`` of a key that already has an object."""


class ObjectLeased(PoolError):
    """The object is protected by a live read lease."""


class ObjectBusy(PoolError):
    """An in-flight copy of the object did not finish within ``io_wait_timeout_s``."""


class LeaseExpired(PoolError):
    """``renew`` of a lease that expired or was released; its objects may be gone."""


class PoolFullError(PoolError):
    """No room for ``needed`` blocks: ``free`` free blocks plus ``evictable`` evictable ones."""

    def __init__(self, *, key: bytes | None, needed: int, free: int, evictable: int = 0, num_blocks: int = 0,
                 policy: str = "") -> None:
        super().__init__(
            f"host pool full: {needed} block(s) needed, {free} free + {evictable} evictable of {num_blocks} "
            f"(eviction policy {policy or '?'}); release leases, remove finished requests, or enlarge the pool",
            key=key,
        )
        self.needed = needed
        self.free = free
        self.evictable = evictable


# --------------------------------------------------------------------------------------------
# Geometry
# --------------------------------------------------------------------------------------------


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


@dataclass(frozen=True)
class PoolGeometry:
    """Shape of a pool: ``num_blocks`` blocks of ``block_size`` tokens over ``len(plane_row_bytes)`` planes.

    ``plane_labels`` optionally names each plane ``(layer, "main"|"indexer")`` (see ``plane_index``).
    """

    block_size: int
    plane_row_bytes: tuple[int, ...]
    num_blocks: int
    plane_labels: tuple[tuple[int, str], ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "plane_row_bytes", tuple(self.plane_row_bytes))
        object.__setattr__(self, "plane_labels", tuple(tuple(x) for x in self.plane_labels))
        if not _is_int(self.block_size) or self.block_size < 1:
            raise ValueError(f"block_size must be an int >= 1, got {self.block_size!r}")
        if not self.plane_row_bytes:
            raise ValueError("plane_row_bytes must name at least one plane")
        for p, rb in enumerate(self.plane_row_bytes):
            if not _is_int(rb) or rb < 1:
                raise ValueError(f"plane_row_bytes[{p}] must be an int >= 1, got {rb!r}")
        if not _is_int(self.num_blocks) or self.num_blocks < 1:
            raise ValueError(f"num_blocks must be an int >= 1, got {self.num_blocks!r}")
        if self.plane_labels:
            if len(self.plane_labels) != len(self.plane_row_bytes):
                raise ValueError(
                    f"plane_labels has {len(self.plane_labels)} entries for {len(self.plane_row_bytes)} planes"
                )
            for label in self.plane_labels:
                if len(label) != 2 or not _is_int(label[0]) or label[0] < 0 or label[1] not in PLANE_KINDS:
                    raise ValueError(f"plane label {label!r} must be (layer >= 0, one of {PLANE_KINDS})")
            if len(set(self.plane_labels)) != len(self.plane_labels):
                raise ValueError(f"plane_labels must be unique, got {self.plane_labels}")

    @property
    def num_planes(self) -> int:
        return len(self.plane_row_bytes)

    @property
    def block_bytes(self) -> int:
        """Bytes of one block over all planes (one object)."""
        return self.block_size * sum(self.plane_row_bytes)

    @property
    def total_bytes(self) -> int:
        """Data bytes of the whole pool (headers and alignment excluded)."""
        return self.block_bytes * self.num_blocks

    def plane_bytes(self, p: int) -> int:
        return self.num_blocks * self.block_size * self.plane_row_bytes[self.check_plane(p)]

    def check_plane(self, p: int) -> int:
        if not _is_int(p) or not 0 <= p < self.num_planes:
            raise ValueError(f"plane must be an int in [0, {self.num_planes}), got {p!r}")
        return p

    def plane_index(self, layer: int, kind: str = "main") -> int:
        """Plane of ``(layer, kind)``; ValueError if the geometry has no such labelled plane."""
        try:
            return self.plane_labels.index((layer, kind))
        except ValueError:
            raise ValueError(
                f"no plane for (layer={layer!r}, kind={kind!r}); labelled planes: {list(self.plane_labels) or 'none'}"
            ) from None

    @classmethod
    def for_capacity(
        cls,
        block_size: int,
        plane_row_bytes: Sequence[int],
        capacity_bytes: int,
        plane_labels: Sequence[tuple[int, str]] = (),
    ) -> "PoolGeometry":
        """As many blocks as fit in ``capacity_bytes`` (``capacity_bytes // block_bytes``)."""
        probe = cls(block_size, tuple(plane_row_bytes), 1, tuple(plane_labels))
        if not _is_int(capacity_bytes) or capacity_bytes < 0:
            raise ValueError(f"capacity_bytes must be an int >= 0, got {capacity_bytes!r}")
        num_blocks = capacity_bytes // probe.block_bytes
        if num_blocks == 0:
            raise ValueError(
                f"capacity_bytes={capacity_bytes} holds no block: one block is block_bytes={probe.block_bytes} "
                f"(block_size={block_size} x {sum(probe.plane_row_bytes)} bytes/token over {probe.num_planes} "
                f"planes); raise the capacity to at least {probe.block_bytes}"
            )
        return cls(block_size, probe.plane_row_bytes, num_blocks, probe.plane_labels)

    @classmethod
    def from_layout(cls, layout: KVLayout, capacity_bytes: int, *, include_indexer: bool) -> "PoolGeometry":
        """Planes per layer in physical order: its main cache, then its indexer cache (if asked and present)."""
        if not isinstance(layout, KVLayout):
            raise ValueError(f"layout must be a KVLayout, got {type(layout).__name__}")
        rows: list[int] = []
        labels: list[tuple[int, str]] = []
        for layer in layout.layers:
            rows.append(layer.main.row_bytes)
            labels.append((layer.index, "main"))
            if include_indexer and layer.indexer is not None:
                rows.append(layer.indexer.row_bytes)
                labels.append((layer.index, "indexer"))
        return cls.for_capacity(layout.block_size, rows, capacity_bytes, labels)

    def to_dict(self) -> dict:
        return {
            "block_size": self.block_size,
            "plane_row_bytes": list(self.plane_row_bytes),
            "num_blocks": self.num_blocks,
            "plane_labels": [list(x) for x in self.plane_labels],
        }

    @classmethod
    def from_dict(cls, d: dict) -> "PoolGeometry":
        try:
            return cls(d["block_size"], tuple(d["plane_row_bytes"]), d["num_blocks"],
                       tuple(tuple(x) for x in d.get("plane_labels", ())))
        except (KeyError, TypeError) as e:
            raise ValueError(f"bad pool geometry {d!r}: {e}") from None


# --------------------------------------------------------------------------------------------
# Shared-memory segment
# --------------------------------------------------------------------------------------------

SHM_DIR = "/dev/shm"
SEGMENT_PREFIX = "kvoffload-"
SEGMENT_MAGIC = b"KVOFFPL\x00"
SEGMENT_VERSION = 1
_HEADER = struct.Struct("<8sIIQ")  # magic, version, json_len, data_offset
_PAGE = 4096
_NAME_RE = re.compile(r"^[A-Za-z0-9_.-]{1,200}$")


def _round_up(x: int, a: int) -> int:
    return (x + a - 1) // a * a


class SharedSegment:
    """Named shared memory ``/dev/shm/kvoffload-<name>``: header, then plane-major data.

    Header: magic, version, JSON length, data offset, then JSON (geometry, plane offsets relative
    to the data offset). Plane p is a contiguous, page-aligned
    ``[num_blocks, block_size, row_bytes_p]`` uint8 region, so a gather over one plane has a
    regular block stride. ``create`` fails if the name exists unless ``replace=True`` (which
    unlinks the stale name first; processes still mapping it keep their old memory). Used as a
    context manager, the creator closes *and unlinks* on exit; an attacher only closes. ``close``
    is safe while plane views are alive: the mapping then lives until the last view is freed.
    """

    def __init__(self, name: str, path: str, mm: mmap.mmap, geometry: PoolGeometry,
                 plane_offsets: list[int], owner: bool) -> None:
        self.name = name
        self.path = path
        self.geometry = geometry
        self.plane_offsets = tuple(plane_offsets)
        self.owner = owner
        self.size_bytes = len(mm)
        self._mmap: mmap.mmap | None = mm
        self._mv: memoryview | None = memoryview(mm)  # torch views hold this export: see close()
        self._planes: list[torch.Tensor] = [
            torch.frombuffer(self._mv, dtype=torch.uint8, count=geometry.plane_bytes(p), offset=off).view(
                geometry.num_blocks, geometry.block_size, geometry.plane_row_bytes[p]
            )
            for p, off in enumerate(plane_offsets)
        ]

    @staticmethod
    def path_for(name: str) -> str:
        if not isinstance(name, str) or not _NAME_RE.match(name):
            raise ValueError(f"segment name must match {_NAME_RE.pattern} (no slashes), got {name!r}")
        return os.path.join(SHM_DIR, SEGMENT_PREFIX + name)

    @classmethod
    def create(cls, name: str, geometry: PoolGeometry, *, replace: bool = False) -> "SharedSegment":
        if not isinstance(geometry, PoolGeometry):
            raise ValueError(f"geometry must be a PoolGeometry, got {type(geometry).__name__}")
        path = cls.path_for(name)
        if not os.path.isdir(SHM_DIR):
            raise OSError(f"{SHM_DIR} does not exist: the embedded host pool needs POSIX shared memory")
        rel, off = [], 0  # plane offsets relative to the data start, page-aligned
        for p in range(geometry.num_planes):
            rel.append(off)
            off = _round_up(off + geometry.plane_bytes(p), _PAGE)
        meta = json.dumps({"geometry": geometry.to_dict(), "plane_offsets": rel}).encode()
        data_offset = _round_up(_HEADER.size + len(meta), _PAGE)
        size = data_offset + off
        flags = os.O_CREAT | os.O_EXCL | os.O_RDWR
        try:
            fd = os.open(path, flags, 0o600)
        except FileExistsError:
            if not replace:
                raise FileExistsError(
                    f"shared segment {path} already exists: attach() to share it, or create(..., replace=True) "
                    f"to discard a stale one"
                ) from None
            os.unlink(path)
            fd = os.open(path, flags, 0o600)
        try:
            try:
                if hasattr(os, "posix_fallocate"):
                    os.posix_fallocate(fd, 0, size)  # reserve now: a sparse tmpfs file SIGBUSes when full
                else:  # pragma: no cover
                    os.ftruncate(fd, size)
            except OSError as e:
                st = os.statvfs(SHM_DIR)
                raise OSError(
                    f"cannot reserve {size} bytes for {path} ({e.strerror}); {SHM_DIR} has "
                    f"{st.f_bavail * st.f_frsize} bytes free: enlarge it (docker --shm-size) or shrink the pool"
                ) from None
            mm = mmap.mmap(fd, size)
        except BaseException:
            os.close(fd)
            os.unlink(path)
            raise
        os.close(fd)
        mm[_HEADER.size : _HEADER.size + len(meta)] = meta
        mm[: _HEADER.size] = _HEADER.pack(SEGMENT_MAGIC, SEGMENT_VERSION, len(meta), data_offset)  # magic last
        return cls(name, path, mm, geometry, [data_offset + o for o in rel], owner=True)

    @classmethod
    def attach(cls, name: str) -> "SharedSegment":
        path = cls.path_for(name)
        try:
            fd = os.open(path, os.O_RDWR)
        except FileNotFoundError:
            raise FileNotFoundError(f"no shared segment {path}: has the pool owner created it?") from None
        try:
            size = os.fstat(fd).st_size
            if size < _HEADER.size:
                raise ValueError(f"{path} is not a kvoffload pool segment ({size} bytes, no header)")
            mm = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        try:
            magic, version, meta_len, data_offset = _HEADER.unpack(mm[: _HEADER.size])
            if magic != SEGMENT_MAGIC:
                raise ValueError(
                    f"{path} is not a kvoffload pool segment (magic {magic!r}, expected {SEGMENT_MAGIC!r}); "
                    f"if it was just created, its header may not be written yet"
                )
            if version != SEGMENT_VERSION:
                raise ValueError(f"{path} has segment version {version}; this kvcore reads {SEGMENT_VERSION}")
            meta = json.loads(bytes(mm[_HEADER.size : _HEADER.size + meta_len]))
            geometry = PoolGeometry.from_dict(meta["geometry"])
            offsets = [data_offset + int(o) for o in meta["plane_offsets"]]
            if len(offsets) != geometry.num_planes or any(
                o < data_offset or o + geometry.plane_bytes(p) > size for p, o in enumerate(offsets)
            ):
                raise ValueError(f"{path} header does not match its size {size}: {meta}")
        except BaseException:
            mm.close()
            raise
        return cls(name, path, mm, geometry, offsets, owner=False)

    @property
    def closed(self) -> bool:
        return self._mmap is None

    def plane(self, p: int) -> torch.Tensor:
        """uint8 view ``[num_blocks, block_size, row_bytes_p]`` of plane p (shares the memory)."""
        if self._mmap is None:
            raise ValueError(f"segment {self.path} is closed")
        return self._planes[self.geometry.check_plane(p)]

    def close(self) -> None:
        """Unmap (now, or when the last outstanding plane view is freed). Idempotent."""
        if self._mmap is None:
            return
        mm, self._mmap, self._mv, self._planes = self._mmap, None, None, []
        try:
            mm.close()
        except BufferError:
            pass  # views still alive hold the mapping; it is unmapped when they are freed

    def unlink(self) -> None:
        """Remove the name; existing mappings stay valid. Idempotent (a missing name is ignored)."""
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass

    def __enter__(self) -> "SharedSegment":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
        if self.owner:
            self.unlink()

    def __repr__(self) -> str:
        return f"SharedSegment({self.path!r}, {self.size_bytes} bytes, owner={self.owner}, closed={self.closed})"


# --------------------------------------------------------------------------------------------
# Stats, leases, eviction policy
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


class Lease:
    """A read lease on ``keys``: until ``deadline`` (``time.monotonic()`` seconds) the objects are
    neither evicted, removed nor rewritten.

    The holder releases it with ``release()`` (idempotent; also on ``with`` exit) or extends it with
    ``renew(ttl_ms)``. If the deadline passes first, the lease expires (lazily, on the pool's next
    operation): it stops protecting, ``renew`` raises ``LeaseExpired``, and data already copied out
    stays valid while block ids read before may now name other objects.
    """

    def __init__(self, keys: tuple[bytes, ...], deadline: float, pool: "HostPoolBackend") -> None:
        # pool: the backend that granted it; it implements _lease_live/_lease_release/_lease_renew.
        self.keys = keys
        self._deadline = deadline
        self._pool = pool
        self._state = "live"  # live | released | expired; changed only under the pool lock

    @property
    def deadline(self) -> float:
        return self._deadline

    @property
    def live(self) -> bool:
        return self._pool._lease_live(self)

    def release(self) -> None:
        self._pool._lease_release(self)

    def renew(self, ttl_ms: int) -> float:
        """Move the deadline to now + ttl_ms; returns it. ``LeaseExpired`` if no longer live."""
        return self._pool._lease_renew(self, ttl_ms)

    def __enter__(self) -> "Lease":
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def __repr__(self) -> str:
        return f"Lease({len(self.keys)} keys, {self._state}, deadline={self._deadline:.3f})"


class EvictionPolicy(ABC):
    """Chooses victims among complete objects. The pool notifies it; ``victims`` has no side effects."""

    @abstractmethod
    def on_complete(self, key: bytes) -> None:
        """The object became complete (evictable unless leased or in copy)."""

    @abstractmethod
    def on_access(self, key: bytes) -> None:
        """A complete object was read or leased."""

    @abstractmethod
    def on_remove(self, key: bytes) -> None:
        """The object was removed, evicted, or became incomplete (being rewritten)."""

    @abstractmethod
    def victims(self, num_needed: int, can_evict: Callable[[bytes], bool]) -> list[bytes]:
        """Up to ``num_needed`` keys, best victim first, each with ``can_evict(key)`` True."""


class LRUEviction(EvictionPolicy):
    """Least-recently-used complete, unleased objects first (the prefill prefix cache)."""

    def __init__(self) -> None:
        self._order: OrderedDict[bytes, None] = OrderedDict()

    def on_complete(self, key: bytes) -> None:
        self._order[key] = None
        self._order.move_to_end(key)

    def on_access(self, key: bytes) -> None:
        if key in self._order:
            self._order.move_to_end(key)

    def on_remove(self, key: bytes) -> None:
        self._order.pop(key, None)

    def victims(self, num_needed: int, can_evict: Callable[[bytes], bool]) -> list[bytes]:
        if num_needed <= 0:
            return []
        return list(itertools.islice((k for k in self._order if can_evict(k)), num_needed))


class NoEviction(EvictionPolicy):
    """Never evict (the decode pool, whose blocks are owned by live requests): full is ``PoolFullError``."""

    def on_complete(self, key: bytes) -> None:
        pass

    def on_access(self, key: bytes) -> None:
        pass

    def on_remove(self, key: bytes) -> None:
        pass

    def victims(self, num_needed: int, can_evict: Callable[[bytes], bool]) -> list[bytes]:
        return []


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


def _check_keys(keys: Sequence[bytes], *, unique: bool) -> list[bytes]:
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
        self._lease_count: dict[bytes, int] = {}
        self._lease_heap: list[tuple[float, int, Lease]] = []
        self._lease_seq = itertools.count()
        self._live_leases = 0
        self._lease_expiries = 0
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
        self._expire(time.monotonic())

    def _expire(self, now: float) -> None:
        heap = self._lease_heap
        while heap and heap[0][0] <= now:
            deadline, _, lease = heapq.heappop(heap)
            if lease._state == "live" and lease._deadline == deadline:
                lease._state = "expired"
                self._drop_lease_counts(lease)
                self._lease_expiries += 1

    def _drop_lease_counts(self, lease: Lease) -> None:
        self._live_leases -= 1
        for k in lease.keys:
            c = self._lease_count[k] - 1
            if c:
                self._lease_count[k] = c
            else:
                del self._lease_count[k]

    def _complete_mask(self, ids: list[int]) -> list[bool]:
        if not ids:
            return []
        return self._written[torch.tensor(ids, dtype=torch.long)].all(1).tolist()

    def _resolve(self, keys: list[bytes], *, complete: bool) -> list[int]:
        ids = []
        for k in keys:
            bid = self._index.get(k)
            if bid is None:
                raise ObjectNotFound(f"no object for key {k!r}", key=k)
            ids.append(bid)
        if complete:
            for k, ok in zip(keys, self._complete_mask(ids)):
                if not ok:
                    raise IncompleteObject(f"object {k!r} is not completely written", key=k)
        return ids

    def _can_evict(self, key: bytes) -> bool:
        bid = self._index.get(key)
        return bid is not None and key not in self._lease_count and bid not in self._pins \
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

    def _shortfall_victims(self, n: int) -> tuple[int, list[bytes]]:
        free = len(self._free)
        return free, self._policy.victims(n - free, self._can_evict) if n > free else []

    # ---- engine thread -------------------------------------------------------------------------

    def can_alloc(self, keys: Sequence[bytes]) -> bool:
        keys = _check_keys(keys, unique=True)
        with self._cond:
            self._begin()
            if any(k in self._index for k in keys):
                return False
            free, victims = self._shortfall_victims(len(keys))
            return free + len(victims) >= len(keys)

    def alloc(self, keys: Sequence[bytes]) -> list[int]:
        keys = _check_keys(keys, unique=True)
        with self._cond:
            self._begin()
            for k in keys:
                if k in self._index:
                    raise ObjectExists(f"key {k!r} already has an object (block {self._index[k]})", key=k)
            free, victims = self._shortfall_victims(len(keys))
            if free + len(victims) < len(keys):
                raise PoolFullError(key=keys[free + len(victims)], needed=len(keys), free=free,
                                    evictable=len(victims), num_blocks=self.geometry.num_blocks,
                                    policy=type(self._policy).__name__)
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
        keys = _check_keys(keys, unique=False)
        with self._cond:
            self._begin()
            ids = torch.tensor([self._index.get(k, -1) for k in keys], dtype=torch.long)  # [n]
            present = ids >= 0
            out = torch.zeros(len(keys), dtype=torch.bool)
            out[present] = self._written[ids[present]].all(1)
            return out.tolist()

    def lease(self, keys: Sequence[bytes], ttl_ms: int) -> Lease:
        keys = _check_keys(keys, unique=True)
        if not _is_int(ttl_ms) or ttl_ms <= 0:
            raise ValueError(f"ttl_ms must be an int > 0, got {ttl_ms!r}")
        with self._cond:
            self._begin()
            self._resolve(keys, complete=True)
            lease = Lease(tuple(keys), time.monotonic() + ttl_ms / 1000, self)
            for k in keys:
                self._lease_count[k] = self._lease_count.get(k, 0) + 1
                self._policy.on_access(k)
            self._live_leases += 1
            heapq.heappush(self._lease_heap, (lease._deadline, next(self._lease_seq), lease))
            return lease

    def remove(self, keys: Sequence[bytes]) -> None:
        keys = _check_keys(keys, unique=False)
        deadline = time.monotonic() + self._io_wait_timeout_s
        with self._cond:
            while True:
                self._begin()
                present = [k for k in dict.fromkeys(keys) if k in self._index]
                for k in present:
                    if k in self._lease_count:
                        raise ObjectLeased(f"cannot remove {k!r}: {self._lease_count[k]} live lease(s)", key=k)
                if self._wait_unpinned(present, deadline, "remove"):
                    break
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
                live_leases=self._live_leases, lease_expiries=self._lease_expiries, evictions=self._evictions,
            )

    # ---- transfer threads ----------------------------------------------------------------------

    def put_from(self, keys: Sequence[bytes], plane: int, src: torch.Tensor) -> None:
        keys = _check_keys(keys, unique=True)
        plane = self.geometry.check_plane(plane)
        src_u8 = _as_block_bytes(src, "src", len(keys), self.geometry, plane)  # [n, block_size, row_bytes]
        deadline = time.monotonic() + self._io_wait_timeout_s
        with self._cond:
            while True:
                self._begin()
                ids = self._resolve(keys, complete=False)
                for k in keys:
                    if k in self._lease_count:
                        raise ObjectLeased(f"cannot write {k!r}: {self._lease_count[k]} live lease(s)", key=k)
                was_complete = [k for k, c in zip(keys, self._complete_mask(ids)) if c]
                if self._wait_unpinned(was_complete, deadline, "put_from"):  # readers of a complete object
                    break
            if not keys:
                return
            ids_t = torch.tensor(ids, dtype=torch.long)
            for k in was_complete:
                self._policy.on_remove(k)  # being rewritten: not evictable, reads as incomplete
            self._written[ids_t, plane] = False
            self._pin(ids, +1)
        ok = False
        try:
            self._segment.plane(plane).index_copy_(0, ids_t, src_u8)
            ok = True
        finally:
            with self._cond:
                self._pin(ids, -1)
                if ok:
                    self._written[ids_t, plane] = True
                    for k, c in zip(keys, self._complete_mask(ids)):
                        if c:
                            self._policy.on_complete(k)
                self._cond.notify_all()

    def get_into(self, keys: Sequence[bytes], plane: int, dst: torch.Tensor) -> None:
        keys = _check_keys(keys, unique=False)
        plane = self.geometry.check_plane(plane)
        dst_u8 = _as_block_bytes(dst, "dst", len(keys), self.geometry, plane)  # [n, block_size, row_bytes]
        with self._cond:
            self._begin()
            ids = self._resolve(keys, complete=True)
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
        keys = _check_keys(keys, unique=False)
        with self._cond:
            self._begin()
            return self._resolve(keys, complete=False)

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

    # ---- lease callbacks -----------------------------------------------------------------------

    def _lease_live(self, lease: Lease) -> bool:
        with self._cond:
            self._expire(time.monotonic())
            return lease._state == "live"

    def _lease_release(self, lease: Lease) -> None:
        with self._cond:
            self._expire(time.monotonic())
            if lease._state == "live":
                lease._state = "released"
                self._drop_lease_counts(lease)

    def _lease_renew(self, lease: Lease, ttl_ms: int) -> float:
        if not _is_int(ttl_ms) or ttl_ms <= 0:
            raise ValueError(f"ttl_ms must be an int > 0, got {ttl_ms!r}")
        with self._cond:
            self._expire(time.monotonic())
            if lease._state != "live":
                raise LeaseExpired(f"lease on {len(lease.keys)} key(s) is {lease._state}; its objects may be gone",
                                   key=lease.keys[0] if lease.keys else None)
            lease._deadline = time.monotonic() + ttl_ms / 1000
            heapq.heappush(self._lease_heap, (lease._deadline, next(self._lease_seq), lease))
            return lease._deadline
