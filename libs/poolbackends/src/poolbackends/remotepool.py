"""``RemoteHostPool``: the embedded host KV pool with its index in the MetaStore.

A LocalService (a prefill or decode process) contributes DRAM as its own ``SharedSegment`` and
registers it with the MetaStore, which indexes every registered pool: key -> (pool, block id,
written planes), read leases, LRU eviction. ``RemoteHostPool`` is the ``HostPoolBackend`` over that
index, so callers written for ``LocalHostPool`` (the prefill engine) run unchanged. Where the hook
map of ``kvcore.pool.host_pool`` says "blocks: lock only", read "one or a few MetaStore RPCs, each
bounded by the client's ``timeout_s`` (``MetaStoreUnavailable`` past it)".

Hook -> MetaStore calls (all from any thread; the gRPC client is thread-safe)
------------------------------------------------------------------------------
``can_alloc`` / ``alloc``    Alloc (dry run / real) in this pool only; eviction is the MetaStore's
                             LRU over this pool's complete, unleased objects.
``put_from(keys, p, src)``   Lease (a copy lease, ``copy_lease_ttl_ms``) -> copy into this pool's
                             segment -> MarkWritten -> ReleaseLease. Only objects of this pool.
                             Written planes are write-once, as in every backend: the same bytes
                             again are a no-op, other bytes raise ``PlaneWritten``.
``put_planes_from``          The same three calls for several planes at once (the prefill saves a
                             layer's main KV and indexer keys with one).
``get_into(keys, p, dst)``   Lease -> (Lookup, for objects in other pools) -> copy from this
                             pool's segment or another pool's, attached by name and cached ->
                             ReleaseLease. Other pools must be on this host (``host_id``); a pool
                             on another host raises ``PoolError``: the cross-host data path is not
                             available for it.
``exists`` / ``lease`` / ``remove`` / ``block_ids`` / ``stats``
                             Exists / Lease / Remove / Lookup / Stats. ``lease`` returns a
                             ``RemoteLease`` (a ``kvcore.pool.leases.Lease``; release is an RPC).
                             ``remove`` first waits (``io_wait_timeout_s``, then ``ObjectBusy``)
                             for this process's copies of the keys; another process's copy lease
                             is a lease (``ObjectLeased``). ``block_ids`` of an object in another
                             pool raises ``PoolError``: ``plane(p)`` views only this pool.
``plane(p)`` / ``geometry``  This pool's segment; no RPC.

Lifecycle (whoever built the pool)
----------------------------------
``create``/``__init__`` register the segment and keep it registered (``poolbackends.membership``:
heartbeats; with ``rejoin=True`` a restarted MetaStore gets the pool registered again). Once the
MetaStore no longer knows the pool, every hook raises ``PoolNotRegistered`` saying why, until a
re-join. ``close()`` stops the heartbeats, deregisters, closes attached segments and closes and
unlinks the segment it owns. Idempotent.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager

import structlog
import torch

from kvcore.hotcache.gather import scatter_blocks
from kvcore.pool.geometry import PoolGeometry
from kvcore.pool.host_pool import (
    HostPoolBackend,
    IncompleteObject,
    ObjectBusy,
    ObjectExists,
    PoolError,
    PoolFullError,
    PoolStats,
    _as_block_bytes,
    check_keys,
    check_open_segment,
    check_positive,
    check_same_bytes,
)
from kvcore.pool.leases import check_ttl_ms
from kvcore.pool.segment import SharedSegment
from kvcore.pool.segment import host_id as this_host_id
from poolbackends.client import MetaStoreClient, RemoteLease
from poolbackends.membership import PoolMembership
from poolbackends.peersegments import PeerSegments

log = structlog.get_logger(__name__)


class RemoteHostPool(HostPoolBackend):
    """A ``HostPoolBackend`` whose index lives in the MetaStore (see the module docstring).

    ``RemoteHostPool(client, segment)`` registers an existing segment under ``client.pool_id`` and
    leaves segment and client open on ``close``; ``RemoteHostPool.create(target, pool_id, name,
    geometry)`` makes both and releases both on ``close``.
    """

    def __init__(
        self,
        client: MetaStoreClient,
        segment: SharedSegment,
        *,
        host_id: str | None = None,
        heartbeat_interval_ms: int | None = None,
        replace: bool = False,
        copy_lease_ttl_ms: int = 30_000,
        io_wait_timeout_s: float = 30.0,
        owns_segment: bool = False,
        owns_client: bool = False,
        rejoin: bool = False,
    ) -> None:
        if not isinstance(client, MetaStoreClient) or not client.pool_id:
            raise ValueError("client must be a MetaStoreClient built with pool_id=<this pool's id>")
        check_open_segment(segment)
        check_ttl_ms(copy_lease_ttl_ms)
        check_positive("io_wait_timeout_s", io_wait_timeout_s)
        self._client = client
        self._segment = segment
        self.pool_id: str = client.pool_id
        self.host_id = host_id or this_host_id()
        self._copy_lease_ttl_ms = copy_lease_ttl_ms
        self._io_wait_timeout_s = io_wait_timeout_s
        self._owns_segment, self._owns_client = owns_segment, owns_client
        self._cond = threading.Condition(threading.Lock())
        self._copies: dict[bytes, int] = {}  # key -> this process's in-flight copies
        self._peers = PeerSegments(self.pool_id, self.host_id, segment.geometry)
        self._closed = False
        self.membership = PoolMembership(
            client,
            segment.name,
            segment.geometry,
            self.host_id,
            heartbeat_interval_ms=heartbeat_interval_ms,
            replace=replace,
            rejoin=rejoin,
            ready_to_rejoin=self._copies_over,
        )

    @classmethod
    def create(
        cls,
        target: str,
        pool_id: str,
        name: str,
        geometry: PoolGeometry,
        *,
        host_id: str | None = None,
        heartbeat_interval_ms: int | None = None,
        replace: bool = False,
        timeout_s: float = 5.0,
        copy_lease_ttl_ms: int = 30_000,
        io_wait_timeout_s: float = 30.0,
        rejoin: bool = False,
    ) -> RemoteHostPool:
        """Create segment ``name`` (``replace``: a stale one is discarded) and register it as ``pool_id``
        with the MetaStore at ``target`` (``replace``: a live registration of ``pool_id`` is dropped)."""
        segment = SharedSegment.create(name, geometry, replace=replace)
        client = None
        try:
            client = MetaStoreClient(target, pool_id=pool_id, timeout_s=timeout_s)
            return cls(
                client,
                segment,
                host_id=host_id,
                heartbeat_interval_ms=heartbeat_interval_ms,
                replace=replace,
                copy_lease_ttl_ms=copy_lease_ttl_ms,
                io_wait_timeout_s=io_wait_timeout_s,
                owns_segment=True,
                owns_client=True,
                rejoin=rejoin,
            )
        except BaseException:
            if client is not None:
                client.close()
            segment.close()
            segment.unlink()
            raise

    # ---- state -----------------------------------------------------------------------------------

    @property
    def geometry(self) -> PoolGeometry:
        return self._segment.geometry

    @property
    def segment(self) -> SharedSegment:
        return self._segment

    @property
    def client(self) -> MetaStoreClient:
        return self._client

    @property
    def alive(self) -> bool:
        """Open and, as far as this process knows, registered with the MetaStore."""
        return self.membership.alive

    def not_ready(self) -> str:
        """Why the pool cannot serve now ("" when it can; see ``PoolMembership.not_ready``)."""
        return self.membership.not_ready()

    def heartbeat(self) -> int:
        """Beat once now (see ``PoolMembership.heartbeat``)."""
        return self.membership.heartbeat()

    def _check_usable(self) -> None:
        self.membership.check_usable()

    def _copies_over(self) -> bool:
        """Wait (up to ``io_wait_timeout_s``) until no copy of this process is in flight; False if one still is."""
        with self._cond:
            return self._cond.wait_for(lambda: not self._copies, timeout=self._io_wait_timeout_s)

    # ---- copies ----------------------------------------------------------------------------------

    @contextmanager
    def _copying(self, keys: list[bytes], what: str) -> Iterator[RemoteLease]:
        """Count keys as in copy in this process and hold a copy lease on them (its locations)."""
        with self._cond:
            self._check_usable()  # a dead pool starts no copy: its locations may be handed out again
            for k in keys:
                self._copies[k] = self._copies.get(k, 0) + 1
        try:
            lease = self._client.lease(keys, self._copy_lease_ttl_ms, holder=f"{self.pool_id}/{what}")
            try:
                yield lease
            finally:
                try:
                    lease.release()
                except PoolError as e:  # it expires on its own after copy_lease_ttl_ms
                    log.warning(
                        "copy_lease_release_failed", pool_id=self.pool_id, lease_id=lease.lease_id, error=str(e)
                    )
        finally:
            with self._cond:
                for k in keys:
                    c = self._copies[k] - 1
                    if c:
                        self._copies[k] = c
                    else:
                        del self._copies[k]
                self._cond.notify_all()

    # ---- engine thread ---------------------------------------------------------------------------

    def can_alloc(self, keys: Sequence[bytes]) -> bool:
        keys = check_keys(keys, unique=True)
        self._check_usable()
        if not keys:
            return True
        try:
            self.membership.own_pool_call(self._client.check_alloc, keys)
        except (ObjectExists, PoolFullError):
            return False
        return True

    def alloc(self, keys: Sequence[bytes]) -> list[int]:
        keys = check_keys(keys, unique=True)
        self._check_usable()
        if not keys:
            return []
        return self.membership.own_pool_call(self._client.alloc, keys)

    def exists(self, keys: Sequence[bytes]) -> list[bool]:
        keys = check_keys(keys, unique=False)
        self._check_usable()
        return self._client.exists(keys) if keys else []

    def lease(self, keys: Sequence[bytes], ttl_ms: int) -> RemoteLease:  # a kvcore.pool.leases.Lease
        keys = check_keys(keys, unique=True)
        check_ttl_ms(ttl_ms)
        self._check_usable()
        return self._client.lease(keys, ttl_ms, holder=self.pool_id)

    def remove(self, keys: Sequence[bytes]) -> None:
        keys = check_keys(keys, unique=False)
        self._check_usable()
        if not keys:
            return
        deadline = time.monotonic() + self._io_wait_timeout_s
        with self._cond:  # held through the RPC, so no copy of ours starts in between
            while (busy := next((k for k in keys if k in self._copies), None)) is not None:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise ObjectBusy(
                        f"remove: a copy of {busy!r} is still in flight after {self._io_wait_timeout_s} s", key=busy
                    )
                self._cond.wait(left)
            self._client.remove(keys)

    def stats(self) -> PoolStats:
        self._check_usable()
        return self.membership.own_pool_call(self._client.stats)

    # ---- transfer threads ------------------------------------------------------------------------

    def put_from(self, keys: Sequence[bytes], plane: int, src: torch.Tensor) -> None:
        self.put_planes_from(keys, {plane: src})

    def put_planes_from(self, keys: Sequence[bytes], srcs: Mapping[int, torch.Tensor]) -> None:
        keys = check_keys(keys, unique=True)
        g = self.geometry
        planes = sorted(g.check_plane(p) for p in srcs)
        if len(set(planes)) != len(planes):
            raise ValueError(f"put_planes_from: planes {list(srcs)} name one plane twice")
        src_u8 = {p: _as_block_bytes(srcs[p], "src", len(keys), g, p) for p in planes}  # [n, block_size, row_bytes]
        self._check_usable()
        if not keys or not planes:
            return
        with self._copying(keys, "put_from") as lease:
            for k, loc in zip(keys, lease.locations):
                if loc.pool_id != self.pool_id:
                    raise PoolError(
                        f"put_from: object {k!r} lives in pool {loc.pool_id!r}; pool "
                        f"{self.pool_id!r} writes only objects it allocated",
                        key=k,
                    )
            ids = torch.tensor([loc.block_id for loc in lease.locations], dtype=torch.long)  # [n]
            written = {p: torch.tensor([p in loc.written_planes for loc in lease.locations]) for p in planes}  # [n]
            for plane in planes:  # every plane checked before any is written
                check_same_bytes(keys, plane, self._segment.plane(plane), ids, written[plane], src_u8[plane])
            for plane in planes:
                dst = self._segment.plane(plane)  # [num_blocks, block_size, row_bytes]
                fresh = ~written[plane]
                if bool(fresh.all()):
                    scatter_blocks(dst, ids, src_u8[plane])
                elif bool(fresh.any()):
                    scatter_blocks(dst, ids[fresh], src_u8[plane][fresh])
            self._client.mark_written(keys, planes)

    def get_into(self, keys: Sequence[bytes], plane: int, dst: torch.Tensor) -> None:
        keys = check_keys(keys, unique=False)
        g = self.geometry
        plane = g.check_plane(plane)
        dst_u8 = _as_block_bytes(dst, "dst", len(keys), g, plane)  # [n, block_size, row_bytes]
        self._check_usable()
        if not keys:
            return
        unique = list(dict.fromkeys(keys))
        with self._copying(unique, "get_into") as lease:
            where = {loc.key: loc for loc in lease.locations}
            locs = [where[k] for k in keys]
            for k, loc in zip(keys, locs):
                if plane not in loc.written_planes:
                    raise IncompleteObject(f"object {k!r} has no written plane {plane}", key=k)
            rows: dict[str, list[int]] = {}  # pool id -> positions in keys
            for i, loc in enumerate(locs):
                rows.setdefault(loc.pool_id, []).append(i)
            others = [p for p in rows if p != self.pool_id]
            records = self._client.lookup([keys[rows[p][0]] for p in others])[1] if others else {}
            for pool_id, pos in rows.items():
                src = (
                    self._segment.plane(plane)
                    if pool_id == self.pool_id
                    else self._peers.plane(records.get(pool_id), pool_id, plane, keys[pos[0]])
                )
                ids = torch.tensor([locs[i].block_id for i in pos], dtype=torch.long)  # [m]
                if len(pos) == len(keys):
                    torch.index_select(src, 0, ids, out=dst_u8)
                else:
                    dst_u8[torch.tensor(pos, dtype=torch.long)] = src.index_select(0, ids)

    def block_ids(self, keys: Sequence[bytes]) -> list[int]:
        keys = check_keys(keys, unique=False)
        self._check_usable()
        if not keys:
            return []
        locs, _ = self._client.lookup(keys)
        for k, loc in zip(keys, locs):
            if loc.pool_id != self.pool_id:
                raise PoolError(
                    f"block_ids: object {k!r} lives in pool {loc.pool_id!r}, and plane(p) views only "
                    f"pool {self.pool_id!r}: read it with get_into",
                    key=k,
                )
        return [loc.block_id for loc in locs]

    def plane(self, p: int) -> torch.Tensor:
        self._check_usable()
        return self._segment.plane(p)

    # ---- lifecycle -------------------------------------------------------------------------------

    def close(self) -> None:
        with self._cond:
            if self._closed:
                return
            self._closed = True
        self.membership.close()
        if self._owns_client:
            self._client.close()
        self._peers.close()
        if self._owns_segment:
            self._segment.close()
            self._segment.unlink()
        log.info("remote_pool_closed", pool_id=self.pool_id)

    def __repr__(self) -> str:
        state = "closed" if self._closed else "dead" if self.membership.dead else "live"
        return f"RemoteHostPool({self.pool_id!r}, {self._client.target!r}, segment={self._segment.name!r}, {state})"
