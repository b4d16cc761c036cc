"""The prefill's host pool, opened by its backend's ``kvcore.pool.registry`` entry through
``poolbackends.registry`` (``host_pool``), and what it says about itself: whether the prefill can
take requests (``pool_not_ready``) and its Stats counters (``pool_counters``)."""

from __future__ import annotations

from kvoffload_prefill.options import PrefillConfig
from poolbackends.registry import PoolOpenError, PoolRequest, open_pool, readiness
from svcruntime.serving import StartupError


def host_pool(cfg: PrefillConfig, geometry, name: str):
    """The prefill's host pool on its store config's backend. Backend ``kvoffload``: indexed by the metastore
    (``--metastore``, resolved by ``options.pool_flags``) or in this process. Backend ``mooncake``: a
    ``MooncakeHostPool`` of its own client of the mooncake_master (``mooncake_master``), reachable by
    peers at ``--host``. Backend ``memcache``: a ``MemcacheHostPool`` whose LocalService starts from the
    mmc-local.conf (``--local-config`` / ``$MMC_LOCAL_CONFIG_PATH``). A pool its backend cannot open
    here (a missing wheel, a master that does not answer in time, no Ascend driver, a bad conf) is a
    start-up error naming the backend and the cause (never the embedded pool instead)."""
    request = PoolRequest(
        cfg.settings.store.model_copy(update={"metastore": cfg.pool.metastore}),
        geometry,
        name,
        pool_id=f"prefill-{cfg.host}:{cfg.port}",
        host=cfg.host,
        local_config=cfg.pool.pool_local_config,
    )
    try:
        return open_pool(request)
    except PoolOpenError as e:
        raise StartupError(str(e)) from None


def pool_not_ready(store, pool) -> str:
    """Why the prefill cannot take requests now ("" when it can), as the backend of ``store`` says:
    e.g. its pool is not registered with the metastore, or the metastore does not answer; or the
    mooncake_master does not answer, or the Mooncake pool's upkeep failed. A pool kept in this
    process is always ready."""
    return readiness(store.backend)(pool)


def pool_counters(pool) -> tuple[dict[str, int], str]:
    """The pool's Stats counters and "", or ``pool_available`` 0 and why it cannot say (e.g. the
    metastore is down or forgot the pool: Stats still answers)."""
    try:
        stats = pool.stats()
    except Exception as exc:  # noqa: BLE001 - whatever the pool's Stats fails with is why it cannot say
        return {"pool_available": 0}, repr(exc)
    return {
        "pool_available": 1,
        "pool_used_bytes": stats.used_bytes,
        "pool_used_blocks": stats.used_blocks,
        "pool_live_leases": stats.live_leases,
        "pool_complete_objects": stats.complete_objects,
    }, ""
