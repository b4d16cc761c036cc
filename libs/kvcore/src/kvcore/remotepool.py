"""``RemoteHostPool``: the embedded host KV pool with its index in the MetaStore.

A LocalService (a prefill or decode process) contributes DRAM as its own ``SharedSegment`` and
registers it with the MetaStore, which indexes every registered pool: key -> (pool, block id,
written planes), read leases, LRU eviction. ``RemoteHostPool`` is the ``HostPoolBackend`` over that
index, so callers written for ``LocalHostPool`` (the prefill engine) run unchanged. Where the hook
map of ``kvcore.hostpool`` says "blocks: lock only", read "one or a few MetaStore RPCs, each
bounded by the client's ``timeout_s`` (``MetaStoreUnavailable`` past it)".

Hook -> MetaStore calls (all from any thread; the gRPC client is thread-safe)
------------------------------------------------------------------------------
``can_alloc`` / ``alloc``    Alloc (dry run / real) in this pool only; eviction is the MetaStore's
                             LRU over this pool's complete, unleased objects.
``put_from(keys, p, src)``   Lease (a copy lease, ``copy_lease_ttl_ms``) -> copy into this pool's
                             segment -> MarkWritten -> ReleaseLease. Only objects of this pool. A
                             written plane is never rewritten: other processes may read it under
                             leases the index does not report, so the same bytes again are a no-op
                             and other bytes raise ``ObjectLeased``.
``get_into(keys, p, dst)``   Lease -> (Lookup, for objects in other pools) -> copy from this
                             pool's segment or another pool's, attached by name and cached ->
                             ReleaseLease. Other pools must be on this host (``host_id``); a pool
                             on another host raises ``PoolError``: the cross-host data path is not
                             available for it.
``exists`` / ``lease`` / ``remove`` / ``block_ids`` / ``stats``
                             Exists / Lease / Remove / Lookup / Stats. ``lease`` returns a
                             ``RemoteLease`` (same surface as ``Lease``; release is an RPC).
                             ``remove`` first waits (``io_wait_timeout_s``, then ``ObjectBusy``)
                             for this process's copies of the keys; another process's copy lease
                             is a lease (``ObjectLeased``). ``block_ids`` of an object in another
                             pool raises ``PoolError``: ``plane(p)`` views only this pool.
``plane(p)`` / ``geometry``  This pool's segment; no RPC.

Lifecycle (whoever built the pool)
----------------------------------
``create``/``__init__`` register the segment (RegisterPool; ``WorldSizeExceeded`` when the MetaStore
holds ``world_size`` pools) and start a daemon thread that heartbeats every
``heartbeat_interval_ms`` (default: the MetaStore's suggestion, a third of its timeout). A failed
beat is logged and retried at the next interval. Once the MetaStore answers that the pool is not
registered (it expired, or was deregistered or replaced), the pool is dead: its objects are gone
and every hook raises ``PoolNotRegistered`` saying so — unless it was built with ``rejoin=True``
(what a service wants: a restarted MetaStore must not retire the node): then the next beat
registers the same segment again, empty as far as the index knows, and the hooks work again. ``close()`` stops the heartbeats,
deregisters, closes attached segments and closes and unlinks the segment it owns. Idempotent.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import TypeVar

import structlog
import torch

from kvcore.hostpool import (
    HostPoolBackend,
    IncompleteObject,
    ObjectBusy,
    ObjectExists,
    ObjectLeased,
    ObjectNotFound,
    PoolError,
    PoolFullError,
    PoolStats,
    _as_block_bytes,
    check_keys,
)
from kvcore.leases import check_ttl_ms
from kvcore.metaclient import MetaStoreClient, PoolNotRegistered, PoolRecord, RemoteLease, WorldSizeExceeded
from kvcore.segment import PoolGeometry, SharedSegment

log = structlog.get_logger(__name__)
T = TypeVar("T")


def default_host_id() -> str:
    """This host's id for the MetaStore: the hostname (a container's own, as is its /dev/shm)."""
    return socket.gethostname()


class RemoteHostPool(HostPoolBackend):
    """A ``HostPoolBackend`` whose index lives in the MetaStore (see the module docstring).

    ``RemoteHostPool(client, segment)`` registers an existing segment under ``client.pool_id`` and
    leaves segment and client open on ``close``; ``RemoteHostPool.create(target, pool_id, name,
    geometry)`` makes both and releases both on ``close``.
    """

    def __init__(self, client: MetaStoreClient, segment: SharedSegment, *, host_id: str | None = None,
                 heartbeat_interval_ms: int | None = None, replace: bool = False, copy_lease_ttl_ms: int = 30_000,
                 io_wait_timeout_s: float = 30.0, owns_segment: bool = False, owns_client: bool = False,
                 rejoin: bool = False) -> None:
        if not isinstance(client, MetaStoreClient) or not client.pool_id:
            raise ValueError("client must be a MetaStoreClient built with pool_id=<this pool's id>")
        if not isinstance(segment, SharedSegment) or segment.closed:
            raise ValueError("segment must be an open SharedSegment")
        check_ttl_ms(copy_lease_ttl_ms)
        if not io_wait_timeout_s > 0:
            raise ValueError(f"io_wait_timeout_s must be > 0, got {io_wait_timeout_s}")
        self._client = client
        self._segment = segment
        self.pool_id: str = client.pool_id
        self.host_id = host_id or default_host_id()
        self._copy_lease_ttl_ms = copy_lease_ttl_ms
        self._io_wait_timeout_s = io_wait_timeout_s
        self._owns_segment, self._owns_client = owns_segment, owns_client
        self._cond = threading.Condition(threading.Lock())
        self._copies: dict[bytes, int] = {}  # key -> this process's in-flight copies
        self._attached: dict[str, tuple[str, tuple[int, int], SharedSegment]] = {}  # pool -> (name, inode, seg)
        self._closed = False
        self._dead: str | None = None  # why the MetaStore no longer knows this pool
        self._rejoin = rejoin
        self.rejoins = 0
        self._heartbeat_failures = 0
        try:
            reply = client.register_pool(segment.name, segment.geometry, host=self.host_id, replace=replace)
        except WorldSizeExceeded as e:
            raise WorldSizeExceeded(f"the MetaStore at {client.target} refused pool {self.pool_id!r}: {e}") from None
        self.heartbeat_timeout_ms = int(reply.heartbeat_timeout_ms)
        self.lease_ttl_ms = int(reply.lease_ttl_ms)
        interval = int(reply.heartbeat_interval_ms) if heartbeat_interval_ms is None else heartbeat_interval_ms
        if isinstance(interval, bool) or not isinstance(interval, int) or not 0 < interval < self.heartbeat_timeout_ms:
            client.deregister_pool()
            raise ValueError(f"heartbeat_interval_ms must be an int in [1, {self.heartbeat_timeout_ms}) (the "
                             f"MetaStore's heartbeat timeout), got {heartbeat_interval_ms!r}")
        self.heartbeat_interval_ms = interval
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._heartbeat_loop, name=f"kv-heartbeat-{self.pool_id}",
                                        daemon=True)
        self._thread.start()
        log.info("remote_pool_registered", pool_id=self.pool_id, target=client.target, segment=segment.name,
                 host=self.host_id, num_blocks=segment.geometry.num_blocks, heartbeat_interval_ms=interval,
                 num_pools=int(reply.num_pools), world_size=int(reply.world_size))

    @classmethod
    def create(cls, target: str, pool_id: str, name: str, geometry: PoolGeometry, *, host_id: str | None = None,
               heartbeat_interval_ms: int | None = None, replace: bool = False, timeout_s: float = 5.0,
               copy_lease_ttl_ms: int = 30_000, io_wait_timeout_s: float = 30.0,
               rejoin: bool = False) -> "RemoteHostPool":
        """Create segment ``name`` (``replace``: a stale one is discarded) and register it as ``pool_id``
        with the MetaStore at ``target`` (``replace``: a live registration of ``pool_id`` is dropped)."""
        segment = SharedSegment.create(name, geometry, replace=replace)
        client = None
        try:
            client = MetaStoreClient(target, pool_id=pool_id, timeout_s=timeout_s)
            return cls(client, segment, host_id=host_id, heartbeat_interval_ms=heartbeat_interval_ms,
                       replace=replace, copy_lease_ttl_ms=copy_lease_ttl_ms, io_wait_timeout_s=io_wait_timeout_s,
                       owns_segment=True, owns_client=True, rejoin=rejoin)
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
        return not self._closed and self._dead is None

    @property
    def heartbeat_failures(self) -> int:
        """Heartbeats that failed without an answer (each was logged and retried)."""
        return self._heartbeat_failures

    def _check_usable(self) -> None:
        if self._closed:
            raise PoolError(f"remote host pool {self.pool_id!r} is closed")
        if self._dead is not None:
            raise PoolNotRegistered(
                f"pool {self.pool_id!r} is no longer registered with the MetaStore at {self._client.target} "
                f"({self._dead}); every object it held is gone: close it and create it again (replace=True "
                f"reuses the name)")

    def _mark_dead(self, why: str) -> None:
        with self._cond:
            if self._dead is None:
                self._dead = why
                log.error("remote_pool_dead", pool_id=self.pool_id, target=self._client.target, reason=why)

    def _own_pool_call(self, fn: Callable[..., T], *args: object) -> T:
        """A call whose PoolNotRegistered can only be about this pool: it marks the pool dead."""
        try:
            return fn(*args)
        except PoolNotRegistered as e:
            self._mark_dead(str(e))
            self._check_usable()
            raise

    # ---- heartbeats ------------------------------------------------------------------------------

    def heartbeat(self) -> int:
        """Beat once now; ms until the MetaStore expires the pool without another beat.

        ``PoolNotRegistered`` (and the pool is dead from now on) if the MetaStore dropped it."""
        self._check_usable()
        return self._own_pool_call(self._client.heartbeat)

    def _heartbeat_loop(self) -> None:
        while not self._stop.wait(self.heartbeat_interval_ms / 1000):
            try:
                self.heartbeat()
            except PoolNotRegistered:
                if not self._rejoin:
                    return  # dead: hooks raise from now on
                self._try_rejoin()
            except PoolError as e:
                if self._closed:
                    return
                self._heartbeat_failures += 1
                log.warning("remote_pool_heartbeat_failed", pool_id=self.pool_id, target=self._client.target,
                            error=str(e), failures=self._heartbeat_failures,
                            retry_in_ms=self.heartbeat_interval_ms)
            except Exception:  # noqa: BLE001 - keep beating whatever one call did
                self._heartbeat_failures += 1
                log.exception("remote_pool_heartbeat_error", pool_id=self.pool_id)

    def _try_rejoin(self) -> None:
        """Register the segment again under the same pool id (the index starts empty) — once the
        copies that began before the pool died are over: they hold block locations of the old index,
        which the new one will hand out again."""
        with self._cond:
            if not self._cond.wait_for(lambda: not self._copies, timeout=self._io_wait_timeout_s):
                log.warning("remote_pool_rejoin_waiting", pool_id=self.pool_id, copies=len(self._copies))
                return
        try:
            self._client.register_pool(self._segment.name, self._segment.geometry, host=self.host_id, replace=True)
        except Exception as e:  # noqa: BLE001 - tried again at the next beat
            self._heartbeat_failures += 1
            log.warning("remote_pool_rejoin_failed", pool_id=self.pool_id, target=self._client.target, error=str(e))
            return
        with self._cond:
            self._dead = None
            self.rejoins += 1
        log.warning("remote_pool_rejoined", pool_id=self.pool_id, target=self._client.target, rejoins=self.rejoins)

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
                    log.warning("copy_lease_release_failed", pool_id=self.pool_id, lease_id=lease.lease_id,
                                error=str(e))
        finally:
            with self._cond:
                for k in keys:
                    c = self._copies[k] - 1
                    if c:
                        self._copies[k] = c
                    else:
                        del self._copies[k]
                self._cond.notify_all()

    def _other_plane(self, record: PoolRecord | None, pool_id: str, plane: int, key: bytes) -> torch.Tensor:
        """Plane ``plane`` of another pool's segment on this host (attached once, re-attached if replaced)."""
        if record is None:
            raise ObjectNotFound(f"object {key!r}: its pool {pool_id!r} is no longer registered", key=key)
        if record.host != self.host_id:
            raise PoolError(
                f"object {key!r} lives in pool {pool_id!r} on host {record.host!r}, and this process is on "
                f"{self.host_id!r}: the cross-host data path is not available for the pool (RemoteHostPool "
                f"reads other pools through same-host shared memory only)", key=key)
        g, mine = record.geometry, self.geometry
        if (g.block_size, g.plane_row_bytes, g.plane_labels) != (mine.block_size, mine.plane_row_bytes,
                                                                 mine.plane_labels):
            raise PoolError(f"object {key!r} lives in pool {pool_id!r} whose planes ({g}) differ from pool "
                            f"{self.pool_id!r}'s ({mine}): plane {plane} would mean another cache", key=key)
        path = SharedSegment.path_for(record.segment_name)
        with self._cond:
            try:
                st = os.stat(path)
            except FileNotFoundError:
                raise ObjectNotFound(f"object {key!r}: segment {path} of pool {pool_id!r} is gone (its LocalService "
                                     f"exited)", key=key) from None
            inode = (st.st_dev, st.st_ino)
            entry = self._attached.get(pool_id)
            if entry is None or entry[:2] != (record.segment_name, inode):  # new, or recreated under the name
                if entry is not None:
                    entry[2].close()
                seg = SharedSegment.attach(record.segment_name)
                if seg.geometry != g:
                    seg.close()
                    raise PoolError(f"segment {path} has geometry {seg.geometry}, but pool {pool_id!r} registered "
                                    f"{g}", key=key)
                entry = self._attached[pool_id] = (record.segment_name, inode, seg)
            return entry[2].plane(plane)

    # ---- engine thread ---------------------------------------------------------------------------

    def can_alloc(self, keys: Sequence[bytes]) -> bool:
        keys = check_keys(keys, unique=True)
        self._check_usable()
        if not keys:
            return True
        try:
            self._own_pool_call(self._client.check_alloc, keys)
        except (ObjectExists, PoolFullError):
            return False
        return True

    def alloc(self, keys: Sequence[bytes]) -> list[int]:
        keys = check_keys(keys, unique=True)
        self._check_usable()
        if not keys:
            return []
        return self._own_pool_call(self._client.alloc, keys)

    def exists(self, keys: Sequence[bytes]) -> list[bool]:
        keys = check_keys(keys, unique=False)
        self._check_usable()
        return self._client.exists(keys) if keys else []

    def lease(self, keys: Sequence[bytes], ttl_ms: int) -> RemoteLease:
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
                    raise ObjectBusy(f"remove: a copy of {busy!r} is still in flight after "
                                     f"{self._io_wait_timeout_s} s", key=busy)
                self._cond.wait(left)
            self._client.remove(keys)

    def stats(self) -> PoolStats:
        self._check_usable()
        return self._own_pool_call(self._client.stats)

    # ---- transfer threads ------------------------------------------------------------------------

    def put_from(self, keys: Sequence[bytes], plane: int, src: torch.Tensor) -> None:
        keys = check_keys(keys, unique=True)
        g = self.geometry
        plane = g.check_plane(plane)
        src_u8 = _as_block_bytes(src, "src", len(keys), g, plane)  # [n, block_size, row_bytes]
        self._check_usable()
        if not keys:
            return
        with self._copying(keys, "put_from") as lease:
            for k, loc in zip(keys, lease.locations):
                if loc.pool_id != self.pool_id:
                    raise PoolError(f"put_from: object {k!r} lives in pool {loc.pool_id!r}; pool "
                                    f"{self.pool_id!r} writes only objects it allocated", key=k)
            dst = self._segment.plane(plane)  # [num_blocks, block_size, row_bytes]
            ids = torch.tensor([loc.block_id for loc in lease.locations], dtype=torch.long)  # [n]
            written = torch.tensor([plane in loc.written_planes for loc in lease.locations])  # [n]
            if bool(written.any()):
                same = (dst[ids[written]] == src_u8[written]).flatten(1).all(1)  # [n_written]
                if not bool(same.all()):
                    k = [k for k, w in zip(keys, written.tolist()) if w][int((~same).nonzero()[0])]
                    raise ObjectLeased(
                        f"cannot rewrite plane {plane} of {k!r} with other bytes: a written plane of a "
                        f"RemoteHostPool object is immutable (readers in other processes may hold leases); "
                        f"remove the object and alloc it again", key=k)
            fresh = ~written
            if bool(fresh.all()):
                dst.index_copy_(0, ids, src_u8)
            elif bool(fresh.any()):
                dst.index_copy_(0, ids[fresh], src_u8[fresh])
            self._client.mark_written(keys, plane)

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
                src = self._segment.plane(plane) if pool_id == self.pool_id else \
                    self._other_plane(records.get(pool_id), pool_id, plane, keys[pos[0]])
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
                raise PoolError(f"block_ids: object {k!r} lives in pool {loc.pool_id!r}, and plane(p) views only "
                                f"pool {self.pool_id!r}: read it with get_into", key=k)
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
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join(self._client.timeout_s + 1)
        if self._dead is None:
            try:
                self._client.deregister_pool()
            except PoolError as e:  # the MetaStore expires it after heartbeat_timeout_ms
                log.warning("remote_pool_deregister_failed", pool_id=self.pool_id, error=str(e))
        if self._owns_client:
            self._client.close()
        with self._cond:
            attached, self._attached = list(self._attached.values()), {}
        for _, _, seg in attached:
            seg.close()
        if self._owns_segment:
            self._segment.close()
            self._segment.unlink()
        log.info("remote_pool_closed", pool_id=self.pool_id)

    def __repr__(self) -> str:
        state = "closed" if self._closed else "dead" if self._dead else "live"
        return f"RemoteHostPool({self.pool_id!r}, {self._client.target!r}, segment={self._segment.name!r}, {state})"
