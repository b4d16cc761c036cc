"""The mmc conf pair rules (``kvcore.config.mmc_files.mmc_pair``): the guide's two files pass; another
MetaService, another config store or an unknown protocol is refused naming both values and where
each was read; the files come from the arguments, else from ``MMC_*_CONFIG_PATH``."""

import pytest

from kvcore.config.mmc_files import PROTOCOLS, mmc_pair

META = """\
ock.mmc.meta_service_url = tcp://10.0.0.7:5000
ock.mmc.meta_service.config_store_url = tcp://10.0.0.7:6000
ock.mmc.meta.lease_ttl_ms = 30000
ock.mmc.log_level = error
"""
LOCAL = """\
ock.mmc.meta_service_url = tcp://10.0.0.7:5000
ock.mmc.local_service.config_store_url = tcp://10.0.0.7:6000
ock.mmc.local_service.world_size = 256
ock.mmc.local_service.protocol = device_sdma
ock.mmc.local_service.dram.size = 10GB
"""


def files(tmp_path, meta=META, local=LOCAL):
    (tmp_path / "mmc-meta.conf").write_text(meta)
    (tmp_path / "mmc-local.conf").write_text(local)
    return str(tmp_path / "mmc-meta.conf"), str(tmp_path / "mmc-local.conf")


def test_the_guides_files_pass_through_the_environment_and_name_the_metaservice(tmp_path):
    meta, local = files(tmp_path)
    pair = mmc_pair(env={"MMC_META_CONFIG_PATH": meta, "MMC_LOCAL_CONFIG_PATH": local})
    assert (pair.meta_path, pair.local_path) == (meta, local)
    assert (pair.meta_service, pair.metastore, pair.protocol) == (("10.0.0.7", 5000), "10.0.0.7:5000", "device_sdma")
    assert pair.meta_service_where == f"ock.mmc.meta_service_url = tcp://10.0.0.7:5000 ({meta}:1)"
    # an argument wins over the environment; either file alone is read
    only_local = mmc_pair(local_config=local, env={"MMC_LOCAL_CONFIG_PATH": "/nonexistent"})
    assert (only_local.meta_path, only_local.metastore) == (None, "10.0.0.7:5000")
    assert only_local.meta_service_where.endswith(f"({local}:1)")
    nothing = mmc_pair(env={})
    assert (nothing.meta_service, nothing.metastore, nothing.protocol, nothing.meta_service_where) == (
        None,
        None,
        None,
        "",
    )


def test_an_ipv6_metaservice_is_a_bracketed_metastore_address(tmp_path):
    _, local = files(tmp_path, local="ock.mmc.meta_service_url = tcp://[::1]:5000\n")
    assert mmc_pair(local_config=local, env={}).metastore == "[::1]:5000"


@pytest.mark.parametrize(
    ("meta", "local", "message"),
    [
        (
            META,
            LOCAL.replace("10.0.0.7:5000", "10.0.0.8:5000"),
            r"ock\.mmc\.meta_service_url = tcp://10\.0\.0\.8:5000 \(.*mmc-local\.conf:1\) differs from "
            r"ock\.mmc\.meta_service_url = tcp://10\.0\.0\.7:5000 \(.*mmc-meta\.conf:1\): both files must name "
            r"the same MetaService",
        ),
        (
            META,
            LOCAL.replace("10.0.0.7:6000", "10.0.0.7:6001"),
            r"ock\.mmc\.local_service\.config_store_url = tcp://10\.0\.0\.7:6001 \(.*mmc-local\.conf:2\) differs "
            r"from ock\.mmc\.meta_service\.config_store_url = tcp://10\.0\.0\.7:6000 \(.*mmc-meta\.conf:2\): the "
            r"LocalService's config store must be the MetaService's",
        ),
        (
            META,
            LOCAL.replace("device_sdma", "carrier_pigeon"),
            r"ock\.mmc\.local_service\.protocol \(.*mmc-local\.conf:4\): expected one of host_rdma, .*device_sdma, "
            r"got 'carrier_pigeon'",
        ),
        (
            META.replace("tcp://10.0.0.7:5000", "http://10.0.0.7:5000"),
            LOCAL,
            r"ock\.mmc\.meta_service_url \(.*mmc-meta\.conf:1\): expected tcp://HOST:PORT",
        ),
    ],
    ids=["another-metaservice", "another-config-store", "unknown-protocol", "bad-url"],
)
def test_a_broken_rule_is_refused_naming_both_values(tmp_path, meta, local, message):
    meta_path, local_path = files(tmp_path, meta, local)
    with pytest.raises(ValueError, match=message):
        mmc_pair(meta_path, local_path, env={})


def test_the_same_endpoints_spelled_differently_are_the_same(tmp_path):
    meta, local = files(tmp_path, local=LOCAL.replace("tcp://10.0.0.7:6000", "tcp://10.0.0.7:6000/"))
    assert mmc_pair(meta, local, env={}).protocol == "device_sdma"


def test_every_protocol_of_the_library_is_accepted(tmp_path):
    for protocol in PROTOCOLS:
        _, local = files(tmp_path, local=f"ock.mmc.local_service.protocol = {protocol}\n")
        assert mmc_pair(local_config=local, env={}).protocol == protocol
