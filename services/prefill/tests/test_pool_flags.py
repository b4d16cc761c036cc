"""--metastore / --host-pool-gb and the store config's metastore / host_pool_gb: either one, the
flag's default when neither, an error naming both when they disagree; the pool size's one
precedence rule: --host-pool-gb / host_pool_gb > mmc-local.conf's dram.size > 1 GiB."""

from __future__ import annotations

import argparse

import pytest

from kvcore.config.connectors import StoreConnectorConfig
from kvcore.config.errors import ConfigError
from kvoffload_prefill.options import pool_flags

GIB = 2**30
NO_ENV: dict[str, str] = {}


def _args(**kw) -> argparse.Namespace:
    return argparse.Namespace(**{"metastore": None, "host_pool_gb": None, "local_config": None, **kw})


def _conf(tmp_path, size: str = "3GB"):
    path = tmp_path / "mmc-local.conf"
    path.write_text(
        f"# the seed's LocalService\nock.mmc.local_service.world_size = 4\nock.mmc.local_service.dram.size = {size}\n"
    )
    return path


def test_neither_gives_no_metastore_and_one_gib():
    args = _args()
    args = pool_flags(args, StoreConnectorConfig(backend="kvoffload"), NO_ENV)
    assert (args.metastore, args.host_pool_gb, args.host_pool_bytes) == (None, None, GIB)
    assert args.host_pool_source == "default (1 GiB)" and args.host_pool_overrides == ()


def test_the_config_fills_what_the_flags_leave_out():
    args = _args(host_pool_gb=0.5)
    args = pool_flags(
        args, StoreConnectorConfig(backend="kvoffload", metastore="10.0.0.1:5000", host_pool_gb=0.5), NO_ENV
    )
    assert (args.metastore, args.host_pool_bytes, args.host_pool_source) == (
        "10.0.0.1:5000",
        GIB // 2,
        "--host-pool-gb",
    )
    args = _args()
    args = pool_flags(args, StoreConnectorConfig(backend="kvoffload", host_pool_gb=2), NO_ENV)
    assert (args.host_pool_bytes, args.host_pool_source) == (2 * GIB, "kv_connector_extra_config.host_pool_gb")


def test_a_flag_and_a_config_key_that_disagree_name_both():
    with pytest.raises(ConfigError) as e:
        pool_flags(_args(metastore="a:1"), StoreConnectorConfig(backend="kvoffload", metastore="b:2"), NO_ENV)
    assert "--metastore a:1" in str(e.value) and "kv_connector_extra_config.metastore 'b:2'" in str(e.value)


def test_dram_size_sizes_the_pool_unless_a_flag_overrides_it(tmp_path):
    conf = _conf(tmp_path)
    args = _args(local_config=str(conf))
    args = pool_flags(args, StoreConnectorConfig(backend="kvoffload"), NO_ENV)
    assert args.host_pool_bytes == 3 * GIB and args.host_pool_overrides == ()
    assert args.host_pool_source == f"ock.mmc.local_service.dram.size ({conf}:3)"
    args = _args()  # the same file through the seed's variable
    args = pool_flags(args, StoreConnectorConfig(backend="kvoffload"), {"MMC_LOCAL_CONFIG_PATH": str(conf)})
    assert args.host_pool_bytes == 3 * GIB
    args = _args(host_pool_gb=0.25, local_config=str(conf))  # the flag wins, and the log says what it overrode
    args = pool_flags(args, StoreConnectorConfig(backend="kvoffload"), NO_ENV)
    assert (args.host_pool_bytes, args.host_pool_source) == (GIB // 4, "--host-pool-gb")
    assert args.host_pool_overrides == (f"ock.mmc.local_service.dram.size ({conf}:3) = {3 * GIB} bytes",)


def test_a_bad_dram_size_or_missing_file_is_a_config_error_naming_it(tmp_path):
    with pytest.raises(ConfigError, match=r"dram.size \(.*mmc-local.conf:3\): expected a size like 10GB"):
        pool_flags(_args(local_config=str(_conf(tmp_path, "lots"))), StoreConnectorConfig(backend="kvoffload"), NO_ENV)
    with pytest.raises(ConfigError, match=r"expected a size > 0"):
        pool_flags(_args(local_config=str(_conf(tmp_path, "0GB"))), StoreConnectorConfig(backend="kvoffload"), NO_ENV)
    with pytest.raises(ConfigError, match="cannot read conf file .*nope.conf"):
        pool_flags(_args(local_config=str(tmp_path / "nope.conf")), StoreConnectorConfig(backend="kvoffload"), NO_ENV)


def test_the_embedded_pools_index_is_the_mmc_local_confs_metaservice_unless_named(tmp_path):
    conf = tmp_path / "mmc-local.conf"
    conf.write_text("ock.mmc.meta_service_url = tcp://10.0.0.9:5000\nock.mmc.local_service.protocol = host_tcp\n")
    store = StoreConnectorConfig(backend="kvoffload")
    args = _args()  # through the seed's variable, as the guide exports it
    args = pool_flags(args, store, {"MMC_LOCAL_CONFIG_PATH": str(conf)})
    assert (args.metastore, args.metastore_source, args.mmc_protocol) == (
        "10.0.0.9:5000",
        f"ock.mmc.meta_service_url = tcp://10.0.0.9:5000 ({conf}:1)",
        "host_tcp",
    )
    args = _args(metastore="10.0.0.1:5000", local_config=str(conf))  # the flag wins
    args = pool_flags(args, store, NO_ENV)
    assert (args.metastore, args.metastore_source) == ("10.0.0.1:5000", "--metastore")
    args = _args(local_config=str(conf))  # so does the store config
    args = pool_flags(args, StoreConnectorConfig(backend="kvoffload", metastore="10.0.0.2:5000"), NO_ENV)
    assert (args.metastore, args.metastore_source) == ("10.0.0.2:5000", "kv_connector_extra_config.metastore")
    args = _args()  # no file: the index stays in this process
    args = pool_flags(args, store, NO_ENV)
    assert (args.metastore, args.metastore_source, args.mmc_protocol) == (None, None, None)


def test_the_mmc_files_are_checked_as_a_pair(tmp_path):
    meta = tmp_path / "mmc-meta.conf"
    meta.write_text("ock.mmc.meta_service_url = tcp://10.0.0.9:5000\n")
    local = tmp_path / "mmc-local.conf"
    local.write_text("ock.mmc.meta_service_url = tcp://10.0.0.8:5000\n")
    env = {"MMC_META_CONFIG_PATH": str(meta), "MMC_LOCAL_CONFIG_PATH": str(local)}
    with pytest.raises(ConfigError, match=r"tcp://10.0.0.8:5000 \(.*mmc-local.conf:1\) differs from .*10.0.0.9:5000"):
        pool_flags(_args(), StoreConnectorConfig(backend="kvoffload"), env)
    local.write_text("ock.mmc.local_service.protocol = smoke_signals\n")
    with pytest.raises(ConfigError, match=r"ock.mmc.local_service.protocol \(.*:1\): expected one of host_rdma"):
        pool_flags(_args(), StoreConnectorConfig(backend="kvoffload"), env)
