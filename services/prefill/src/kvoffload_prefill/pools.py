"""The prefill's host pool, by backend (``host_pool``), and what it says about itself: whether the
prefill can take requests (``pool_not_ready``) and its Stats counters (``pool_counters``)."""

from __future__ import annotations

import argparse

import structlog
from kvcore.eviction import LRUEviction
from kvcore.hostpool import PoolError
from kvcore.localpool import LocalHostPool
from poolbackends.memcache import MemcacheHostPool
from poolbackends.memcache_client import MemcacheUnavailable
from poolbackends.memcache_meta import MemcacheNotInstalled
from poolbackends.mooncake import MooncakeHostPool
from poolbackends.mooncake_master import MooncakeNotInstalled, port_answers
from poolbackends.remotepool import RemoteHostPool
from svcruntime.serving import StartupError

MOONCAKE_CONNECT_TIMEOUT_S = 5.0  # the mooncake_master must answer within this at start-up
MOONCAKE_PROBE_TIMEOUT_S = 0.5  # readiness: the master's RPC port accepts a connection within this
log = structlog.get_logger(__name__)


def host_pool(args: argparse.Namespace, store, geometry, name: str):
    """The prefill's host pool. Backend ``kvoffload``: indexed by the metastore (``--metastore``) or
    in this process. Backend ``mooncake``: a ``MooncakeHostPool`` of its own client of the
    mooncake_master (``mooncake_master``), reachable by peers at ``--host``; a master that does not
    answer within ``MOONCAKE_CONNECT_TIMEOUT_S``, or a missing wheel, is a start-up error. Backend
    ``memcache``: a ``MemcacheHostPool`` whose LocalService starts from the mmc-local.conf
    (``--local-config`` / ``$MMC_LOCAL_CONFIG_PATH``); where its data path cannot start (no Ascend
    driver), a missing wheel or a bad conf, the start-up error names the cause (never the embedded pool)."""
    if store.backend == "memcache":
        try:
            pool = MemcacheHostPool.connect(geometry, local_config=args.memcache_local_config, eviction=LRUEviction())
        except (PoolError, MemcacheUnavailable, MemcacheNotInstalled, ValueError) as e:
            raise StartupError(f"backend 'memcache': {e}") from None
        log.info("memcache_pool_connected", meta=pool.client.meta_service_url, pool=repr(pool))
        return pool
    if store.backend == "mooncake":
        try:
            pool = MooncakeHostPool.connect(store.mooncake_master, geometry, namespace=store.mooncake_namespace,
                                            eviction=LRUEviction(), store_lease_ttl_ms=store.mooncake_lease_ttl_ms,
                                            connect_timeout_s=MOONCAKE_CONNECT_TIMEOUT_S, local_hostname=args.host)
        except (PoolError, MooncakeNotInstalled) as e:
            raise StartupError(f"backend 'mooncake': {e}") from None
        log.info("mooncake_pool_connected", master=store.mooncake_master, namespace=store.mooncake_namespace,
                 pool=repr(pool))
        return pool
    if not args.metastore:
        return LocalHostPool.create(name, geometry, eviction=LRUEviction())
    return RemoteHostPool.create(args.metastore, f"prefill-{args.host}:{args.port}", name, geometry, replace=True,
                                 rejoin=True)  # a restarted metastore must not retire the prefill


def pool_not_ready(pool) -> str:
    """Why the prefill cannot take requests now ("" when it can): its pool is not registered with
    the metastore, or the metastore does not answer; or the mooncake_master does not answer, or the
    Mooncake pool's upkeep failed (``MooncakeHostPool.not_ready``). A LocalHostPool is always ready."""
    if isinstance(pool, RemoteHostPool):
        return pool.not_ready()
    if isinstance(pool, MooncakeHostPool):
        host, _, port = pool.store.master.rpartition(":")
        if not port_answers(host, int(port), MOONCAKE_PROBE_TIMEOUT_S):
            return (f"the mooncake_master at {pool.store.master} does not answer (down or restarting): the host "
                    f"pool cannot reach Mooncake Store")
        return pool.not_ready()  # e.g. re-putting its objects after a master restart
    return ""


def pool_counters(pool) -> tuple[dict[str, int], str]:
    """The pool's Stats counters and "", or ``pool_available`` 0 and why it cannot say (e.g. the
    metastore is down or forgot the pool: Stats still answers)."""
    try:
        stats = pool.stats()
    except Exception as exc:
        return {"pool_available": 0}, repr(exc)
    return {"pool_available": 1, "pool_used_bytes": stats.used_bytes, "pool_used_blocks": stats.used_blocks,
            "pool_live_leases": stats.live_leases, "pool_complete_objects": stats.complete_objects}, ""
