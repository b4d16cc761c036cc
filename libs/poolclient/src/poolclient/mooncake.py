"""``MooncakeHostPool``: the host KV pool over Mooncake Store (``backend: "mooncake"``).

Where bytes live. A ``MooncakeHostPool`` is a ``kvcore.hostpool.LocalHostPool`` over a
``SharedSegment`` of its own (``/dev/shm/kvoffload-mooncake-<pool id>``, created by the pool and
closed and unlinked on ``close``) whose whole mapping is registered with the store client
(``poolclient.mooncake_objects``). Everything local is ``LocalHostPool``'s own code: the index, free
list, written-plane bitmap, pins, ``LeaseTable``, eviction order, stats and the lock, and the hook
map of ``kvcore.hostpool`` holds as for it ("blocks: lock only" reads "plus bounded store calls"
where a hook below touches the store). Mooncake Store is the shared store: when ``put_from`` writes
an object's last plane, the pool puts the whole object to the store as ONE Mooncake object, key
``<namespace>/<key hex>``, bytes = the block's rows of plane 0, then plane 1, ... (zero-copy from
the registered planes, hard-pinned, placed in this client's own store segment, by
``mooncake_store.MooncakeStore``), with the lock held; a failed put leaves the plane unwritten. So
an object is complete in the store exactly when it exists there; incomplete objects never reach the
store. Other processes and hosts with the same ``namespace`` see it: ``exists`` / ``lease`` /
``get_into`` of a key this pool does not hold ask the store (whole objects are fetched, batches
split at 1024 keys). This pool's own objects are answered locally and never touched in the store
except to put and remove them (a store probe would lease them, see below).

Ownership. The pool that allocated an object owns it: only it writes, evicts and removes it, and
its eviction or ``remove`` removes the store copy too. ``remove`` of a key held only by another
pool is ignored (missing here); ``block_ids`` of such a key raises ``PoolError`` (``plane(p)``
views this pool only: read it with ``get_into``); ``put_from`` raises ``ObjectNotFound``.
``alloc`` of a key complete in the store raises ``ObjectExists`` (written once, across pools); two
pools racing to publish one key: the first put wins and the second is a silent no-op in this
Mooncake (keys are content hashes, so the bytes agree).

Leases. A lease is a record in the local ``LeaseTable`` (released, renewed and expired exactly as
the contract says), also on keys held in the store. Those also hold Mooncake's own lease: the
master leases an object for its ``--default_kv_lease_ttl`` (``store_lease_ttl_ms`` here) whenever a
client checks or reads it; the pool's keeper thread re-checks the store keys under live leases
every third of that TTL, so the owner cannot remove them while the lease lives. The owner removes
with ``force=False``: Mooncake's ``OBJECT_HAS_LEASE`` becomes ``ObjectLeased`` for ``remove``
(nothing removed) and "not evictable" for eviction (the next LRU victim is taken instead).
Mooncake's lease cannot be released early, so a reader's ``exists``, ``get_into``, or released
lease keeps the owner from removing the object for up to ``store_lease_ttl_ms`` more.

Faults. A failed store call raises ``MooncakeStoreError`` (a ``PoolError``) naming the operation,
Mooncake's error code and the master; the batch changed nothing. A master restart loses every key:
the Mooncake client re-mounts its segment by itself, and the keeper notices that this pool's
sentinel key is gone (it checks every ``keeper_interval_s``) and puts every complete object of
the pool again, so the next requests succeed; ``not_ready()`` says why while the keeper's last
check failed, the store does not answer, or the pool is not put again yet (the prefill's
health reports it). Construction without the wheel or ``libibverbs1``
raises ``MooncakeNotInstalled`` saying what to install; without a master it raises within
``connect_timeout_s``.
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import Sequence

import structlog
import torch
from kvcore.eviction import EvictionPolicy
from kvcore.hostpool import LocalHostPool, ObjectExists, ObjectNotFound, PoolError, _as_block_bytes, check_keys
from kvcore.leases import Lease, check_ttl_ms
from kvcore.segment import PoolGeometry, SharedSegment

from poolclient.mooncake_objects import StoreObjects
from poolclient.mooncake_store import MooncakeStore, MooncakeStoreError

log = structlog.get_logger(__name__)


def segment_bytes_for(geometry: PoolGeometry) -> int:
    """A store segment that holds every object of ``geometry`` (allocator slack included)."""
    return ((geometry.num_blocks * geometry.block_bytes * 9 // 8 + (16 << 20)) >> 20) << 20


class MooncakeHostPool(LocalHostPool):
    """A ``LocalHostPool`` whose objects are shared through Mooncake Store (see the module docstring).

    ``MooncakeHostPool(store, geometry)`` uses a connected ``MooncakeStore`` (several pools may share
    one) and leaves it open on ``close``; ``MooncakeHostPool.connect(master, geometry)`` connects its
    own (a segment sized for ``geometry``) and closes it on ``close``. Pools that share objects use
    the same ``namespace``; ``store_lease_ttl_ms`` must equal the master's ``--default_kv_lease_ttl``.
    """

    def __init__(self, store: MooncakeStore, geometry: PoolGeometry, *, namespace: str = "kvoffload",
                 eviction: EvictionPolicy | None = None, store_lease_ttl_ms: int = 5_000,
                 io_wait_timeout_s: float = 30.0, keeper_interval_s: float = 1.0, owns_store: bool = False) -> None:
        if not isinstance(store, MooncakeStore):
            raise ValueError(f"store must be a connected MooncakeStore, got {type(store).__name__}")
        if not isinstance(namespace, str) or not namespace or "/" in namespace:
            raise ValueError(f"namespace must be a non-empty str without '/', got {namespace!r}")
        check_ttl_ms(store_lease_ttl_ms)
        if not keeper_interval_s > 0:
            raise ValueError(f"keeper_interval_s must be > 0, got {keeper_interval_s}")
        self.pool_id = uuid.uuid4().hex
        segment = SharedSegment.create(f"mooncake-{self.pool_id}", geometry)  # ValueError for a bad geometry
        try:
            super().__init__(segment, eviction=eviction, io_wait_timeout_s=io_wait_timeout_s, owns_segment=True)
            self._objects = StoreObjects(store, segment, namespace, self.pool_id)  # registers the segment
            try:
                self._objects.put_sentinel()
            except BaseException:
                self._objects.close()
                raise
        except BaseException:
            segment.close()
            segment.unlink()
            raise
        self._store, self._owns_store = store, owns_store
        self.namespace = namespace
        self._store_lease_ttl_ms = store_lease_ttl_ms
        self._published = torch.zeros(geometry.num_blocks, dtype=torch.bool)  # [num_blocks]: store copy believed there
        self._store_leased: set[bytes] = set()  # keys held in the store that a local lease covers (or did)
        self._stop = threading.Event()
        self._keeper_problem = ""  # why the keeper's last tick failed ("": it succeeded), see not_ready
        self._keeper = threading.Thread(target=self._keep, args=(min(keeper_interval_s, store_lease_ttl_ms / 3000),),
                                        name=f"mooncake-pool-{self.pool_id[:8]}", daemon=True)
        self._keeper.start()

    @classmethod
    def connect(cls, master: str, geometry: PoolGeometry, *, namespace: str = "kvoffload",
                eviction: EvictionPolicy | None = None, store_lease_ttl_ms: int = 5_000,
                io_wait_timeout_s: float = 30.0, keeper_interval_s: float = 1.0, connect_timeout_s: float = 5.0,
                local_hostname: str = "127.0.0.1", protocol: str = "tcp") -> "MooncakeHostPool":
        """Connect a store client of its own to the master at ``master`` and build the pool on it."""
        if not isinstance(geometry, PoolGeometry):
            raise ValueError(f"geometry must be a PoolGeometry, got {type(geometry).__name__}")
        store = MooncakeStore.connect(master, global_segment_bytes=segment_bytes_for(geometry),
                                      local_hostname=local_hostname, protocol=protocol,
                                      connect_timeout_s=connect_timeout_s)
        try:
            return cls(store, geometry, namespace=namespace, eviction=eviction, store_lease_ttl_ms=store_lease_ttl_ms,
                       io_wait_timeout_s=io_wait_timeout_s, keeper_interval_s=keeper_interval_s, owns_store=True)
        except BaseException:
            store.close()
            raise

    @property
    def store(self) -> MooncakeStore:
        return self._store

    # ---- LocalHostPool's hooks (called with the lock held) -----------------------------------------

    def _published_of(self, keys: list[bytes]) -> list[bytes]:
        if not keys:
            return []
        flags = self._published[torch.tensor([self._index[k] for k in keys], dtype=torch.long)].tolist()
        return [k for k, f in zip(keys, flags) if f]

    def _before_drop(self, keys: list[bytes]) -> dict[bytes, str]:
        """Remove the store copies of ``keys`` without force, all or nothing: ``{key: why}`` for those a
        reader elsewhere leases (Mooncake's lease); any other error raises ``MooncakeStoreError``."""
        r = self._objects.remove(self._published_of(keys))
        if r.error is not None or r.leased:
            self._restore(r.removed)
            if r.error is not None:
                raise r.error
            return {k: f"a reader in another process holds Mooncake's lease on it (it lasts up to "
                       f"{self._store_lease_ttl_ms} ms after that reader's last read or lease refresh)"
                    for k in r.leased}
        if keys:
            self._published[torch.tensor([self._index[k] for k in keys], dtype=torch.long)] = False
        return {}

    def _restore(self, keys: list[bytes]) -> None:
        """Put back store copies removed by a batch that then failed; the keeper retries what fails here."""
        ids = [self._index[k] for k in keys]
        try:
            self._objects.put(keys, ids)
        except MooncakeStoreError as e:
            self._published[torch.tensor(ids, dtype=torch.long)] = False
            log.warning("mooncake_restore_failed", pool=self.pool_id[:8], keys=len(keys), error=str(e))

    def _publish(self, keys: list[bytes], ids: list[int]) -> None:
        """Put the objects this ``put_from`` completes to the store, all or none (else it raises)."""
        if keys and self._stop.is_set():
            raise PoolError("host pool is closing")
        self._objects.put(keys, ids)
        if ids:
            self._published[torch.tensor(ids, dtype=torch.long)] = True

    # ---- fall-backs to the store for keys this pool does not hold ---------------------------------

    def _in_store(self, keys: list[bytes], op: str) -> list[bool]:
        """Per key: not in this pool, and complete in the store (which leases it; ``op`` names the caller)."""
        with self._cond:
            self._begin()
            others = list(dict.fromkeys(k for k in keys if k not in self._index))
        found = {k for k, ok in zip(others, self._objects.exists(others, op)) if ok}
        return [k in found for k in keys]

    def can_alloc(self, keys: Sequence[bytes]) -> bool:
        keys = check_keys(keys, unique=True)
        return not any(self._in_store(keys, "can_alloc")) and super().can_alloc(keys)

    def alloc(self, keys: Sequence[bytes]) -> list[int]:
        keys = check_keys(keys, unique=True)
        for k, there in zip(keys, self._in_store(keys, "alloc")):
            if there:
                raise ObjectExists(f"key {k!r} already has an object in Mooncake Store (namespace "
                                   f"{self.namespace!r}): another pool wrote it", key=k)
        return super().alloc(keys)

    def exists(self, keys: Sequence[bytes]) -> list[bool]:
        here = super().exists(keys)
        return [h or s for h, s in zip(here, self._in_store(list(keys), "exists"))]

    def lease(self, keys: Sequence[bytes], ttl_ms: int) -> Lease:
        keys = check_keys(keys, unique=True)
        check_ttl_ms(ttl_ms)
        held = self._in_store(keys, "lease")
        with self._cond:
            self._begin()
            for k, there in zip(keys, held):
                if not there and k not in self._index:  # never here, or removed or evicted meanwhile
                    raise ObjectNotFound(f"no object for key {k!r} in this pool or in Mooncake Store", key=k)
            self._store_leased.update(k for k, there in zip(keys, held) if there)
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
        fetched = self._objects.fetch([k for k, loc in zip(keys, local) if not loc], plane)
        dst_u8[local_t] = mine
        dst_u8[~local_t] = fetched

    def block_ids(self, keys: Sequence[bytes]) -> list[int]:
        try:
            return super().block_ids(keys)
        except ObjectNotFound as e:
            if e.key is not None and self._objects.exists([e.key], "block_ids")[0]:
                raise PoolError(f"block_ids: object {e.key!r} is held in Mooncake Store by another pool, and "
                                f"plane(p) views only this pool: read it with get_into", key=e.key) from None
            raise

    # ---- keeper thread -----------------------------------------------------------------------------

    def _keep(self, interval_s: float) -> None:
        """Refresh Mooncake's lease on store keys under live leases; re-put this pool after a master restart."""
        while not self._stop.wait(interval_s):
            try:
                self._refresh_store_leases()
                self._republish_if_lost()
            except PoolError as e:  # the master is down or restarting (or the pool closed): try again next tick
                self._keeper_problem = f"Mooncake Store at {self._store.master} failed the pool's upkeep: {e}"
                log.warning("mooncake_keeper_failed", pool=self.pool_id[:8], error=str(e))
            else:
                self._keeper_problem = ""

    def not_ready(self) -> str:
        """Why this pool cannot serve now, "" when it can: the keeper's last tick failed, or the store
        does not answer now, or it lost this pool's sentinel (a master restart: the keeper puts the
        pool again within ``keeper_interval_s`` once the client has re-mounted its segment). Any
        thread; one store call (``exists`` of the sentinel), bounded by the client's RPC timeout."""
        if self._keeper_problem:
            return self._keeper_problem
        try:
            present = self._objects.sentinel_present()
        except PoolError as e:
            return f"Mooncake Store at {self._store.master} does not answer: {e}"
        if not present:
            return (f"Mooncake Store at {self._store.master} lost this pool's objects (a master restart?): "
                    f"they are being put again")
        return ""

    def _refresh_store_leases(self) -> None:
        with self._cond:
            self._begin()
            self._store_leased = {k for k in self._store_leased if k in self._leases}
            skeys = [self._objects.key(k) for k in self._store_leased]
        if skeys:
            self._objects.touch(skeys)

    def _republish_if_lost(self) -> None:
        present = self._objects.sentinel_present()
        with self._cond:
            self._begin()
            if not present:  # the master restarted (or dropped our segment): every store copy is gone
                log.warning("mooncake_store_lost_pool", pool=self.pool_id[:8], master=self._store.master)
                self._published[:] = False
                self._objects.put_sentinel()
            lost = (self._written.all(1) & ~self._published).nonzero().flatten().tolist()
            if lost:
                self._objects.put([self._block_key[b] for b in lost], lost)  # type: ignore[misc]
                self._published[torch.tensor(lost, dtype=torch.long)] = True
                log.info("mooncake_pool_republished", pool=self.pool_id[:8], objects=len(lost))

    # ---- lifecycle -------------------------------------------------------------------------------

    def close(self) -> None:
        """Stop the keeper, remove this pool's store copies and sentinel, release the segment (and the
        store client if it owns it). Idempotent."""
        self._stop.set()  # from here no object is published (see _publish)
        self._keeper.join()
        with self._cond:
            if self._closed:
                return
            mine = self._published_of(list(self._index))
        try:
            self._objects.drop_all(mine)
        except PoolError as e:
            log.warning("mooncake_pool_close_remove_failed", pool=self.pool_id[:8], error=str(e))
        self._objects.close()
        super().close()
        if self._owns_store:
            self._store.close()
        log.info("mooncake_pool_closed", pool=self.pool_id[:8], master=self._store.master)

    def __repr__(self) -> str:
        return (f"MooncakeHostPool({self.pool_id[:8]}, master={self._store.master!r}, namespace={self.namespace!r}, "
                f"{'closed' if self._closed else 'open'})")
