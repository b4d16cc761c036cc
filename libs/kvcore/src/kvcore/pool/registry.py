"""The host-pool backends, one entry each: ``POOL_BACKENDS`` (the store config's ``backend`` name ->
``PoolBackend``); ``poolbackends.registry`` runs an entry's hooks (``open_pool``, ``readiness``,
``start_server``).

An entry declares everything about its backend that lives outside the backend's own module: its
config keys (the typed model that validates them, in ``kvcore.config.pool_keys``; which are required, and
which keys of other backends it accepts), an availability probe (``ImportProbe``: the module it
needs and how to install it), the factory that opens its pool, its readiness check, the launcher
of its server, and where it runs beyond the prefill (a stack's ``--pool``; the vLLM store, whose
scheduler asks the backend's ``lookup`` which blocks the pool holds, without opening a pool). Config
validation (``kvcore.config.connectors``), availability (``kvcore.backends``), the prefill, the vLLM
store, ``kvoffload up``, the fault suite and ``kvoffload bench pool`` all read it.

Hooks are named ``"module:attribute"`` and imported when used (``load``), as entry points are:
kvcore cannot import the backends' package (``poolbackends`` depends on kvcore, and calls the
hooks), and nothing imports an optional backend until it runs. This module itself imports neither
pydantic nor torch, so the command line reads the names without paying for either.

Adding a backend: its module in ``libs/poolbackends`` (``open_pool(poolbackends.registry.PoolRequest)``, optionally
``pool_not_ready(pool)``, a ``svcruntime.serverprocess.ServerProcess`` launcher and, for the vLLM store,
``open_lookup(store, timeout_s)``), its keys
model in ``kvcore.config.pool_keys`` when it has keys, its entry below, and its tests
(``tests/integration/test_backend_contract.py``; ``kvoffload bench pool`` names what it measures).
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

EMBEDDED = "kvoffload"  # the embedded backend (host pool, P→D data path): runs everywhere


@dataclass(frozen=True)
class ImportProbe:
    """Availability: the backend can run wherever ``module`` imports; ``install`` says how to get it."""

    module: str
    install: str


@dataclass(frozen=True)
class StackServer:
    """The backend's server in a stack (``kvoffload up --pool NAME``): its ``service`` name (and log
    file), and the words the services' errors name it by (what the fault suite looks for)."""

    service: str
    named: tuple[str, ...]


@dataclass(frozen=True)
class PoolBackend:
    """One host-pool backend (see the module docstring). Hooks are ``"module:attribute"``."""

    name: str  # the store config's "backend"
    factory: str  # (poolbackends.registry.PoolRequest) -> HostPoolBackend; PoolOpenError says why it cannot
    keys: str | None = None  # its kv_connector_extra_config keys: a kvcore.config.pool_keys model
    required: Mapping[str, str] = field(default_factory=dict)  # key -> its rule: required with this backend
    tolerates: frozenset[str] = frozenset()  # keys of other backends it accepts (and does not use)
    probe: ImportProbe | None = None  # None: it runs everywhere
    readiness: str | None = None  # (pool) -> why it cannot serve now, "" when it can; None: always ready
    launcher: str | None = None  # its server: a ServerProcess subclass, ``.start()`` on loopback
    index: str = ""  # where it keeps its index when not in a kvoffload-metastore (--metastore is refused)
    local_config: str = ""  # why it needs an mmc-local.conf (--local-config); "" when it does not
    stack: StackServer | None = None  # None: a stack cannot run it (``kvoffload up --pool``)
    # the vLLM store: (store config, timeout_s) -> poolbackends.registry.PrefixLookup, which blocks the
    # pool holds asked of the server the store config's key ``lookup_server`` names; None: vLLM
    # refuses the backend (``vllm_refusal`` says why)
    lookup: str | None = None
    lookup_server: str = ""
    vllm_refusal: str = ""


MOONCAKE_INSTALL = (
    "install Mooncake Store: scripts/install-mooncake (it runs `apt-get install -y libibverbs1` and "
    "`pip install mooncake-transfer-engine-non-cuda==0.3.13.post1`)"
)
MEMCACHE_INSTALL = "install Memcache: scripts/install-memcache (it runs `pip install memcache_hybrid==1.3.0`)"

POOL_BACKENDS: Mapping[str, PoolBackend] = MappingProxyType(
    {
        b.name: b
        for b in (
            PoolBackend(
                EMBEDDED,
                factory="poolbackends.embedded:open_pool",
                keys="kvcore.config.pool_keys:EmbeddedPoolKeys",
                readiness="poolbackends.embedded:pool_not_ready",
                launcher="poolbackends.metastore_server:MetastoreServer",
                stack=StackServer("metastore", ("MetaStore", "metastore")),
                lookup="poolbackends.embedded:open_lookup",
                lookup_server="metastore",
            ),
            # memcache: whether its data path runs here (an Ascend NPU driver) is its construction's call
            PoolBackend(
                "memcache",
                factory="poolbackends.memcache:open_pool",
                tolerates=frozenset({"metastore"}),
                probe=ImportProbe("memcache_hybrid", MEMCACHE_INSTALL),
                launcher="poolbackends.memcache_meta:MemcacheMetaService",
                index="reads its MetaService from the mmc-local.conf (--local-config or $MMC_LOCAL_CONFIG_PATH)",
                local_config="needs the LocalService's mmc-local.conf (its ock.mmc.meta_service_url, "
                "ock.mmc.local_service.config_store_url, protocol and dram.size)",
                vllm_refusal="the vLLM store has no lookup in Memcache's MetaService yet, and Memcache's data path "
                "needs an Ascend NPU driver: it runs in the kvoffload prefill",
            ),
            # mooncake: runs wherever mooncake.store imports (no NPU); its master is checked when the pool connects
            PoolBackend(
                "mooncake",
                factory="poolbackends.mooncake:open_pool",
                keys="kvcore.config.pool_keys:MooncakePoolKeys",
                required={
                    "mooncake_master": 'must be "HOST:PORT" (the mooncake_master\'s RPC address, e.g. '
                    '"127.0.0.1:50051")'
                },
                probe=ImportProbe("mooncake.store", MOONCAKE_INSTALL),
                readiness="poolbackends.mooncake:pool_not_ready",
                launcher="poolbackends.mooncake_master:MooncakeMaster",
                index="keeps its objects in the mooncake_master (kv_connector_extra_config.mooncake_master)",
                stack=StackServer("mooncake-master", ("Mooncake", "mooncake")),
                lookup="poolbackends.mooncake_lookup:open_lookup",
                lookup_server="mooncake_master",
            ),
        )
    }
)
STORE_BACKENDS: tuple[str, ...] = tuple(POOL_BACKENDS)  # the store config's "backend" choices
STACK_POOLS: tuple[str, ...] = tuple(b.name for b in POOL_BACKENDS.values() if b.stack)  # `kvoffload up --pool`
VLLM_POOLS: tuple[str, ...] = tuple(b.name for b in POOL_BACKENDS.values() if b.lookup)  # the vLLM store's


def load(ref: str) -> Any:
    """The object a ``"module:attribute"`` hook names, its module imported now."""
    module, _, attribute = ref.partition(":")
    out: Any = importlib.import_module(module)
    for part in attribute.split("."):
        out = getattr(out, part)
    return out


def key_models() -> dict[str, Any]:
    """Backend name -> the typed model of its keys (``kvcore.config.pool_keys``), for the backends that have keys."""
    return {b.name: load(b.keys) for b in POOL_BACKENDS.values() if b.keys}
