"""``MooncakeHostPool``: the host KV pool over Mooncake Store (``backend: "mooncake"``).

Where bytes live. A ``MooncakeHostPool`` is a ``poolbackends.storepool.StoreHostPool`` (a
``kvcore.pool.local.LocalHostPool``; the split between keys held here and in the store is its) over a
``SharedSegment`` of its own (``/dev/shm/kvoffload-mooncake-<pool id>``, created by the pool and
closed and unlinked on ``close``) whose whole mapping is registered with the store client
(``poolbackends.mooncake_objects``). Everything local is ``LocalHostPool``'s own code: the index, free
list, written-plane bitmap, pins, ``LeaseTable``, eviction order, stats and the lock, and the hook
map of ``kvcore.pool.host_pool`` holds as for it ("blocks: lock only" reads "plus bounded store calls"
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
health reports it). A dead owner (its process gone; the master lists its objects until its
``--client_ttl``): the first read of its objects fails with TRANSFER_FAIL and removes them from the
store (``mooncake_objects.StoreObjects.read_into``), so the next requests compute them again.
Construction without the wheel or ``libibverbs1``
raises ``MooncakeNotInstalled`` saying what to install; without a master it raises within
``connect_timeout_s``.

As backend ``"mooncake"`` of ``kvcore.pool.registry``: ``open_pool`` (a pool of its own client of the
store config's ``mooncake_master``) and ``pool_not_ready`` (the master's port answers, and
``not_ready``).
"""

from __future__ import annotations

import threading

import structlog
import torch

from kvcore.pool.eviction import EvictionPolicy, LRUEviction
from kvcore.pool.geometry import PoolGeometry
from kvcore.pool.host_pool import PoolError, check_positive
from kvcore.pool.leases import check_ttl_ms
from kvcore.pool.segment import SharedSegment
from poolbackends.mooncake_master import MooncakeNotInstalled, port_answers
from poolbackends.mooncake_objects import StoreObjects
from poolbackends.mooncake_store import MooncakeStore, MooncakeStoreError, address_toward
from poolbackends.registry import PoolOpenError, PoolRequest
from poolbackends.storepool import StoreHostPool, owning, store_bytes_for

log = structlog.get_logger(__name__)

PROBE_TIMEOUT_S = 0.5  # readiness: the master's RPC port accepts a connection within this
segment_bytes_for = store_bytes_for  # a store segment that holds every object of a geometry


class MooncakeHostPool(StoreHostPool):
    """A ``StoreHostPool`` whose objects are shared through Mooncake Store (see the module docstring).

    ``MooncakeHostPool(store, geometry)`` uses a connected ``MooncakeStore`` (several pools may share
    one) and leaves it open on ``close``; ``MooncakeHostPool.connect(master, geometry)`` connects its
    own (a segment sized for ``geometry``) and closes it on ``close``. Pools that share objects use
    the same ``namespace``; ``store_lease_ttl_ms`` must equal the master's ``--default_kv_lease_ttl``.
    """

    STORE = "Mooncake Store"

    def __init__(
        self,
        store: MooncakeStore,
        geometry: PoolGeometry,
        *,
        namespace: str = "kvoffload",
        eviction: EvictionPolicy | None = None,
        store_lease_ttl_ms: int = 5_000,
        io_wait_timeout_s: float = 30.0,
        keeper_interval_s: float = 1.0,
        owns_store: bool = False,
    ) -> None:
        if not isinstance(store, MooncakeStore):
            raise ValueError(f"store must be a connected MooncakeStore, got {type(store).__name__}")
        check_ttl_ms(store_lease_ttl_ms)
        check_positive("keeper_interval_s", keeper_interval_s)
        self._store, self._owns_store = store, owns_store
        self._store_lease_ttl_ms = store_lease_ttl_ms
        super().__init__(
            geometry, prefix="mooncake", namespace=namespace, eviction=eviction, io_wait_timeout_s=io_wait_timeout_s
        )
        self._store_leased: set[bytes] = set()  # keys held in the store that a local lease covers (or did)
        self._keeper_problem = ""  # why the keeper's last tick failed ("": it succeeded), see not_ready
        self._keeper = threading.Thread(
            target=self._keep,
            args=(min(keeper_interval_s, store_lease_ttl_ms / 3000),),
            name=f"mooncake-pool-{self.pool_id[:8]}",
            daemon=True,
        )
        self._keeper.start()

    @classmethod
    def connect(
        cls,
        master: str,
        geometry: PoolGeometry,
        *,
        namespace: str = "kvoffload",
        eviction: EvictionPolicy | None = None,
        store_lease_ttl_ms: int = 5_000,
        io_wait_timeout_s: float = 30.0,
        keeper_interval_s: float = 1.0,
        connect_timeout_s: float = 5.0,
        local_hostname: str = "127.0.0.1",
        protocol: str = "tcp",
    ) -> MooncakeHostPool:
        """Connect a store client of its own to the master at ``master`` and build the pool on it."""
        if not isinstance(geometry, PoolGeometry):
            raise ValueError(f"geometry must be a PoolGeometry, got {type(geometry).__name__}")
        store = MooncakeStore.connect(
            master,
            global_segment_bytes=segment_bytes_for(geometry),
            local_hostname=local_hostname,
            protocol=protocol,
            connect_timeout_s=connect_timeout_s,
        )

        def build() -> MooncakeHostPool:
            return cls(
                store,
                geometry,
                namespace=namespace,
                eviction=eviction,
                store_lease_ttl_ms=store_lease_ttl_ms,
                io_wait_timeout_s=io_wait_timeout_s,
                keeper_interval_s=keeper_interval_s,
                owns_store=True,
            )

        return owning(store, build)

    @property
    def store(self) -> MooncakeStore:
        return self._store

    # ---- the store primitives of StoreHostPool -----------------------------------------------------

    def _attach(self, segment: SharedSegment) -> None:
        self._objects = StoreObjects(self._store, segment, self.namespace, self.pool_id)  # registers the segment
        try:
            self._objects.put_sentinel()
        except BaseException:
            self._objects.close()
            raise

    def _store_put(self, keys: list[bytes], ids: list[int]) -> None:
        self._objects.put(keys, ids)

    def _store_remove(self, keys: list[bytes]) -> dict[bytes, str]:
        """Remove without force, all or nothing: ``{key: why}`` for those a reader elsewhere leases
        (Mooncake's lease); any other error raises ``MooncakeStoreError``."""
        r = self._objects.remove(keys)
        if r.error is None and not r.leased:
            return {}
        self._restore(r.removed)
        if r.error is not None:
            raise r.error
        return {
            k: f"a reader in another process holds Mooncake's lease on it (it lasts up to "
            f"{self._store_lease_ttl_ms} ms after that reader's last read or lease refresh)"
            for k in r.leased
        }

    def _restore(self, keys: list[bytes]) -> None:
        """Put back store copies removed by a batch that then failed; the keeper retries what fails here."""
        ids = [self._index[k] for k in keys]
        try:
            self._objects.put(keys, ids)
        except MooncakeStoreError as e:
            self._published[torch.tensor(ids, dtype=torch.long)] = False
            log.warning("mooncake_restore_failed", pool=self.pool_id[:8], keys=len(keys), error=str(e))

    def _store_exists(self, keys: list[bytes], op: str) -> list[bool]:
        return self._objects.exists(keys, op)  # the master leases those that are there

    def _store_lease(self, keys: list[bytes], ttl_ms: int) -> list[bool]:
        """Mooncake's lease is the one a check grants; the keeper refreshes it while a local lease lives."""
        found = self._objects.exists(keys, "lease")
        with self._cond:
            self._store_leased.update(k for k, ok in zip(keys, found) if ok)
        return found

    def _store_read(self, keys: list[bytes], staging: torch.Tensor) -> None:
        self._objects.read_into(keys, staging)

    def _store_remove_all(self, keys: list[bytes]) -> None:
        self._objects.drop_all(keys)

    def _halt(self) -> None:
        self._keeper.join()

    def _detach(self) -> None:
        self._objects.close()
        if self._owns_store:
            self._store.close()

    # ---- keeper thread -----------------------------------------------------------------------------

    def _keep(self, interval_s: float) -> None:
        """Refresh Mooncake's lease on store keys under live leases; re-put this pool after a master restart."""
        while not self._closing.wait(interval_s):
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
            return (
                f"Mooncake Store at {self._store.master} lost this pool's objects (a master restart?): "
                f"they are being put again"
            )
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
                self._objects.put([self._block_key[b] for b in lost], lost)
                self._published[torch.tensor(lost, dtype=torch.long)] = True
                log.info("mooncake_pool_republished", pool=self.pool_id[:8], objects=len(lost))

    def __repr__(self) -> str:
        return (
            f"MooncakeHostPool({self.pool_id[:8]}, master={self._store.master!r}, namespace={self.namespace!r}, "
            f"{'closed' if self._closed else 'open'})"
        )


def open_pool(request: PoolRequest) -> MooncakeHostPool:
    """The pool of ``request`` on its own client of the store config's ``mooncake_master`` (namespace
    and lease TTL from the config), reachable by peers at ``request.host`` ("": this host's address
    toward the master); ``PoolOpenError`` when the wheel is missing or the master does not answer
    within ``request.timeout_s``."""
    store = request.store
    try:
        host = request.host or address_toward(store.mooncake_master)
        pool = MooncakeHostPool.connect(
            store.mooncake_master,
            request.geometry,
            namespace=store.mooncake_namespace,
            eviction=LRUEviction(),
            store_lease_ttl_ms=store.mooncake_lease_ttl_ms,
            connect_timeout_s=request.timeout_s,
            local_hostname=host,
        )
    except (PoolError, MooncakeNotInstalled) as e:
        raise PoolOpenError(str(e)) from None
    log.info(
        "mooncake_pool_connected",
        master=store.mooncake_master,
        namespace=store.mooncake_namespace,
        host=host,
        pool=repr(pool),
    )
    return pool


def pool_not_ready(pool: MooncakeHostPool) -> str:
    """Why the pool cannot serve now ("" when it can): its mooncake_master does not answer, or the
    pool's upkeep failed (``MooncakeHostPool.not_ready``)."""
    host, _, port = pool.store.master.rpartition(":")
    if not port_answers(host, int(port), PROBE_TIMEOUT_S):
        return (
            f"the mooncake_master at {pool.store.master} does not answer (down or restarting): the host "
            f"pool cannot reach Mooncake Store"
        )
    return pool.not_ready()  # e.g. re-putting its objects after a master restart
