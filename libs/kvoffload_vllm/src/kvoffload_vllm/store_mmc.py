"""The seed's mmc files on a vLLM server: ``MMC_META_CONFIG_PATH`` / ``MMC_LOCAL_CONFIG_PATH``, as the
guide exports them before starting vLLM, give the store connector what its config leaves out.

- The two files are checked as a pair (``kvcore.config.mmc_files.mmc_pair``: the same MetaService, the
  LocalService's config store the MetaService's, a known protocol); a broken rule is a
  ``ConfigError`` naming both values.
- ``metastore`` (backend ``kvoffload``): the mmc-local.conf's ``ock.mmc.meta_service_url`` when the
  config names none (the embedded pool's MetaService is a ``kvoffload-metastore``).
- ``host_pool_gb``: the mmc-local.conf's ``ock.mmc.local_service.dram.size`` when the config names none.

A config key wins over the file; when the two differ, a warning names both. Every value taken from
a file is logged with the file and line it came from. The D2H connector keeps no host pool, so
it reads neither file: set there, the variables are named in a warning (``warn_unread``).
"""

from __future__ import annotations

import os
from collections.abc import Mapping

import structlog

from kvcore.config.connectors import StoreConnectorConfig
from kvcore.config.errors import ConfigError
from kvcore.config.mmc_files import LOCAL_ENV, META_ENV, mmc_pair
from kvcore.pool.registry import EMBEDDED

log = structlog.get_logger("vllm.kvoffload.config")


def with_mmc_files(store: StoreConnectorConfig, env: Mapping[str, str] | None = None) -> StoreConnectorConfig:
    """``store`` with ``metastore`` / ``host_pool_gb`` from the mmc files where it names none (module doc)."""
    try:
        pair = mmc_pair(env=env)
        dram = pair.dram_size()
    except ValueError as e:
        raise ConfigError([str(e)]) from None
    update: dict[str, object] = {}
    if store.backend == EMBEDDED and pair.metastore is not None:
        if not store.metastore:
            update["metastore"] = pair.metastore
            log.info("kvoffload_metastore_from_mmc_conf", metastore=pair.metastore, source=pair.meta_service_where)
        elif store.metastore != pair.metastore:
            log.warning(
                "kvoffload_mmc_conf_overridden",
                key="kv_connector_extra_config.metastore",
                value=store.metastore,
                overrides=pair.meta_service_where,
            )
    if dram is not None:
        size, where = dram
        if store.host_pool_gb is None:
            update["host_pool_gb"] = size / 2**30
            log.info("kvoffload_host_pool_from_mmc_conf", bytes=size, source=where)
        elif int(store.host_pool_gb * 2**30) != size:
            log.warning(
                "kvoffload_mmc_conf_overridden",
                key="kv_connector_extra_config.host_pool_gb",
                value=store.host_pool_gb,
                overrides=f"{where} = {size} bytes",
            )
    return store.model_copy(update=update) if update else store


def warn_unread(connector: str, env: Mapping[str, str] | None = None) -> None:
    """A connector without a host pool (``connector``) names the mmc variables set in ``env``: it reads neither."""
    env = os.environ if env is None else env
    named = [f"${name}={env[name]}" for name in (META_ENV, LOCAL_ENV) if env.get(name)]
    if named:
        log.warning(
            "kvoffload_config_ignored",
            keys=named,
            connector=connector,
            reason="this connector keeps no host pool, so no mmc file is read here (the AscendStoreConnector "
            "reads them)",
        )
