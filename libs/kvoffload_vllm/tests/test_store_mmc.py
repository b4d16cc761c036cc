"""The store connector's config completed from the seed's mmc files (``kvoffload_vllm.store_mmc``): the
MetaService and pool size the config leaves out come from the files, a config key wins (with a
warning naming both), the pair rules are ConfigErrors, and a connector without a pool names the
variables it does not read."""

import pytest
from structlog.testing import capture_logs

from kvcore.config.connectors import StoreConnectorConfig
from kvcore.config.errors import ConfigError
from kvoffload_vllm.store_mmc import warn_unread, with_mmc_files

LOCAL = "ock.mmc.meta_service_url = tcp://10.0.0.9:5000\nock.mmc.local_service.dram.size = 512MB\n"


@pytest.fixture
def env(tmp_path):
    (tmp_path / "mmc-local.conf").write_text(LOCAL)
    return {"MMC_LOCAL_CONFIG_PATH": str(tmp_path / "mmc-local.conf")}


def test_what_the_config_leaves_out_comes_from_the_files(env):
    with capture_logs() as logs:
        store = with_mmc_files(StoreConnectorConfig(backend="kvoffload"), env)
    assert (store.metastore, store.host_pool_gb) == ("10.0.0.9:5000", 0.5)
    events = {e["event"]: e for e in logs}
    assert events["kvoffload_metastore_from_mmc_conf"]["source"].endswith("mmc-local.conf:1)")
    assert events["kvoffload_host_pool_from_mmc_conf"]["bytes"] == 2**29


def test_a_config_key_wins_and_a_warning_names_both(env):
    given = StoreConnectorConfig(backend="kvoffload", metastore="10.0.0.1:5000", host_pool_gb=2)
    with capture_logs() as logs:
        store = with_mmc_files(given, env)
    assert store == given
    warned = {e["key"]: e for e in logs if e["event"] == "kvoffload_mmc_conf_overridden"}
    assert set(warned) == {"kv_connector_extra_config.metastore", "kv_connector_extra_config.host_pool_gb"}
    assert "tcp://10.0.0.9:5000" in warned["kv_connector_extra_config.metastore"]["overrides"]
    assert warned["kv_connector_extra_config.host_pool_gb"]["overrides"].endswith(f"= {2**29} bytes")
    with capture_logs() as logs:  # the same values: nothing to say
        with_mmc_files(StoreConnectorConfig(backend="kvoffload", metastore="10.0.0.9:5000", host_pool_gb=0.5), env)
    assert [e for e in logs if e["event"] == "kvoffload_mmc_conf_overridden"] == []


def test_no_files_change_nothing():
    store = StoreConnectorConfig(backend="kvoffload", metastore="10.0.0.1:5000")
    assert with_mmc_files(store, {}) is store


def test_a_broken_pair_rule_is_a_config_error_naming_both(tmp_path, env):
    (tmp_path / "mmc-meta.conf").write_text("ock.mmc.meta_service_url = tcp://10.0.0.8:5000\n")
    env = {**env, "MMC_META_CONFIG_PATH": str(tmp_path / "mmc-meta.conf")}
    with pytest.raises(ConfigError, match=r"tcp://10.0.0.9:5000 \(.*mmc-local.conf:1\) differs from .*10.0.0.8:5000"):
        with_mmc_files(StoreConnectorConfig(backend="kvoffload"), env)


def test_a_connector_without_a_pool_names_the_variables_it_does_not_read(env):
    with capture_logs() as logs:
        warn_unread("SfaRemoteD2HConnector", env)
        warn_unread("SfaRemoteD2HConnector", {})
    assert len(logs) == 1 and logs[0]["event"] == "kvoffload_config_ignored", logs
    assert logs[0]["keys"] == [f"$MMC_LOCAL_CONFIG_PATH={env['MMC_LOCAL_CONFIG_PATH']}"]
