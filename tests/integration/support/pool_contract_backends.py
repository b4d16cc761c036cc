"""The backends ``test_backend_contract`` runs on: ``BACKENDS`` maps a name to a factory
``(num_blocks, ctx) -> HostPoolBackend`` making an empty LRU pool of ``geometry(num_blocks)``; a new
backend plugs in by adding one. ``local``: ``LocalHostPool``; ``remote``: ``RemoteHostPool`` on an
in-process metastore (one per test, kept in ``ctx``); ``mooncake``: ``MooncakeHostPool`` on one real
mooncake_master and store client for the whole module, which ``stop_mooncake`` ends."""

from __future__ import annotations

import uuid
from collections.abc import Callable

from pool_contract_data import geometry

from kvcore.pool.eviction import LRUEviction
from kvcore.pool.host_pool import HostPoolBackend
from kvcore.pool.local import LocalHostPool
from kvoffload_metastore.config import MetaStoreConfig
from kvoffload_metastore.server import start
from poolbackends.mooncake import MooncakeHostPool
from poolbackends.mooncake_master import MooncakeMaster
from poolbackends.mooncake_store import MooncakeStore
from poolbackends.remotepool import RemoteHostPool


def _name() -> str:
    return f"contract-{uuid.uuid4().hex[:12]}"


def _local(num_blocks: int, _ctx: dict) -> HostPoolBackend:
    return LocalHostPool.create(_name(), geometry(num_blocks), eviction=LRUEviction())


def _remote(num_blocks: int, ctx: dict) -> HostPoolBackend:
    if "metastore" not in ctx:
        ctx["metastore"] = start(
            MetaStoreConfig(port=0, world_size=64, lease_ttl_ms=30_000, heartbeat_timeout_ms=10_000)
        )
    ctx["n"] = ctx.get("n", 0) + 1
    return RemoteHostPool.create(ctx["metastore"].target, f"pool-{ctx['n']}", _name(), geometry(num_blocks))


_MOONCAKE: dict = {}  # one real mooncake_master and store client for the module (a client close takes ~2 s)


def _mooncake(num_blocks: int, _ctx: dict) -> HostPoolBackend:
    if "store" not in _MOONCAKE:
        _MOONCAKE["master"] = MooncakeMaster.start()
        _MOONCAKE["store"] = MooncakeStore.connect(_MOONCAKE["master"].address, global_segment_bytes=64 << 20)
    return MooncakeHostPool(_MOONCAKE["store"], geometry(num_blocks), namespace=_name(), eviction=LRUEviction())


BACKENDS: dict[str, Callable[[int, dict], HostPoolBackend]] = {
    "local": _local,
    "remote": _remote,
    "mooncake": _mooncake,
}


def stop_mooncake() -> None:
    """Close the module's mooncake store client and stop its master (when they were started)."""
    if "store" in _MOONCAKE:
        _MOONCAKE.pop("store").close()
    if "master" in _MOONCAKE:
        _MOONCAKE.pop("master").stop()
