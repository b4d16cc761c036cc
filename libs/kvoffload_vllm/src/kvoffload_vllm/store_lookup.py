"""The store connector's lookup (scheduler side): which of a prompt's blocks the pool holds, asked of the
backend's own index without opening a pool. The backend's ``kvcore.pool.registry`` entry names it
(``lookup``, run by ``poolbackends.registry.open_lookup``) and the config key of the server it asks
(``lookup_server``): the kvoffload-metastore's ``Exists`` (backend ``"kvoffload"``, key ``metastore``),
Mooncake Store's master (``"mooncake"``, key ``mooncake_master``: ``poolbackends.mooncake_lookup``).

``check_lookup_server``: the key the vLLM store needs for it (``store_config`` checks it at start-up).
``open_lookup``: opened once per scheduler at start-up; a server that does not answer then stops vLLM
with a ``ConfigError`` naming the key and the address (a metastore's gRPC channel connects on its
first call instead: its worker's pool registration names it at start-up). Later a lookup that fails
raises a ``PoolError``: the connector serves the request without the pool's prefix cache.
"""

from __future__ import annotations

from kvcore.config.connectors import StoreConnectorConfig
from kvcore.config.errors import ConfigError
from kvcore.config.mmc_files import LOCAL_ENV
from kvcore.pool.registry import POOL_BACKENDS, VLLM_POOLS
from poolbackends.registry import PoolOpenError, PrefixLookup
from poolbackends.registry import open_lookup as open_backend_lookup

# what to do about a missing key, by the key
MISSING = {
    "metastore": "the kvoffload-metastore's HOST:PORT (start one with `kvoffload-metastore`), or an "
    f"mmc-local.conf naming it (ock.mmc.meta_service_url) in ${LOCAL_ENV}",
}


def check_backend(store: StoreConnectorConfig) -> None:
    """``ConfigError`` naming ``backend`` when the vLLM store does not run on it, and why (its entry's
    ``vllm_refusal``)."""
    if store.backend not in VLLM_POOLS:
        raise ConfigError(
            [
                f"kv_connector_extra_config.backend: got {store.backend!r}; inside vLLM the store runs on "
                f"{', '.join(map(repr, VLLM_POOLS))} ({POOL_BACKENDS[store.backend].vllm_refusal})"
            ]
        )


def check_lookup_server(store: StoreConnectorConfig) -> None:
    """``ConfigError`` naming the key of the server the backend's lookup asks, when the config names none."""
    key = POOL_BACKENDS[store.backend].lookup_server
    if not getattr(store, key):
        raise ConfigError(
            [
                f"kv_connector_extra_config.{key}: missing; the AscendStoreConnector looks prefixes up there "
                f"on backend {store.backend!r}: {MISSING.get(key, 'HOST:PORT')}"
            ]
        )


def open_lookup(store: StoreConnectorConfig, timeout_s: float) -> PrefixLookup:
    """The backend's lookup on the server the config names, each call bounded by ``timeout_s``;
    ``ConfigError`` naming the key and why when it cannot open (e.g. no mooncake_master answers)."""
    try:
        return open_backend_lookup(store, timeout_s)
    except PoolOpenError as exc:
        key = POOL_BACKENDS[store.backend].lookup_server
        raise ConfigError([f"kv_connector_extra_config.{key}: {getattr(store, key)!r}: {exc}"]) from None
