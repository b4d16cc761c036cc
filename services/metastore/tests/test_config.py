"""Config from the seed's mmc conf files and flags: a table of valid and invalid files."""

import pytest

from kvcore.config.mmc_files import parse_size_bytes, parse_url
from kvoffload_metastore.config import MetaStoreConfig, build_config
from kvoffload_metastore.server import config_from_args

GUIDE_META = """\
ock.mmc.meta_service_url = tcp://127.0.0.2:5000
ock.mmc.meta_service.config_store_url = tcp://127.0.0.2:6000
ock.mmc.meta.lease_ttl_ms = 30000
ock.mmc.log_level = error
"""
GUIDE_LOCAL = """\
ock.mmc.meta_service_url = tcp://127.0.0.2:5000
ock.mmc.local_service.config_store_url = tcp://127.0.0.2:6000
ock.mmc.local_service.world_size = 256
ock.mmc.local_service.protocol = device_sdma
ock.mmc.local_service.dram.size = 10GB
"""


def conf(tmp_path, text, name="mmc.conf"):
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def test_the_guides_files_through_the_environment(tmp_path):
    env = {
        "MMC_META_CONFIG_PATH": conf(tmp_path, GUIDE_META, "meta.conf"),
        "MMC_LOCAL_CONFIG_PATH": conf(tmp_path, GUIDE_LOCAL, "local.conf"),
    }
    config, notes = build_config(env=env)
    assert (config.host, config.port, config.lease_ttl_ms, config.world_size, config.log_level) == (
        "127.0.0.2",
        5000,
        30000,
        256,
        "error",
    )
    assert config.dram_bytes_per_local_service == 10 * 2**30
    assert config.bind_address == "127.0.0.2:5000" and len(config.sources) == 2
    levels = sorted(level for level, _ in notes)
    assert levels == ["info", "info", "info"]
    assert all("ignored by the embedded backend: " in n for _, n in notes)
    assert any("device SDMA/RDMA" in n and "protocol" in n for _, n in notes)


def test_defaults_without_files():
    config, notes = build_config(env={})
    assert config == MetaStoreConfig() and notes == []
    assert (config.host, config.port, config.lease_ttl_ms, config.world_size) == ("127.0.0.1", 5000, 30000, 256)


def test_flags_override_files(tmp_path):
    path = conf(tmp_path, GUIDE_META)
    config, _ = config_from_args(
        ["--meta-config", path, "--port", "0", "--lease-ttl-ms", "5", "--dram-size", "512MB", "--log-level", "DEBUG"]
    )
    assert (config.host, config.port, config.lease_ttl_ms, config.log_level) == ("127.0.0.2", 0, 5, "debug")
    assert config.dram_bytes_per_local_service == 512 * 2**20


def test_unknown_keys_warn_by_name(tmp_path):
    _, notes = build_config(meta_config=conf(tmp_path, "# comment\n\nock.mmc.nope = 1  # trailing\n"), env={})
    assert notes == [("warning", f"ock.mmc.nope ({tmp_path}/mmc.conf:3) is an unknown key; ignored")]


@pytest.mark.parametrize(
    "text, field, value",
    [
        ("ock.mmc.meta_service_url = tcp://[::1]:5001", "host", "::1"),
        ("ock.mmc.meta_service_url=tcp://meta.local:65535", "port", 65535),
        ("ock.mmc.meta.lease_ttl_ms = 1", "lease_ttl_ms", 1),
        ("ock.mmc.local_service.world_size = 1", "world_size", 1),
        ("ock.mmc.local_service.dram.size = 1GiB", "dram_bytes_per_local_service", 2**30),
        ("ock.mmc.local_service.dram.size = 3 tb", "dram_bytes_per_local_service", 3 * 2**40),
        ("ock.mmc.local_service.dram.size = 4096", "dram_bytes_per_local_service", 4096),
        ("ock.mmc.log_level = WARN", "log_level", "warning"),
    ],
)
def test_valid_files(tmp_path, text, field, value):
    config, _ = build_config(meta_config=conf(tmp_path, text + "\n"), env={})
    assert getattr(config, field) == value


@pytest.mark.parametrize(
    "text, message",
    [
        ("ock.mmc.meta_service_url = http://h:5000", "ock.mmc.meta_service_url (*:1): expected tcp://HOST:PORT"),
        ("ock.mmc.meta_service_url = tcp://h:0", "ock.mmc.meta_service_url (*:1): expected tcp://HOST:PORT"),
        ("ock.mmc.meta_service_url = tcp://h:70000", "port in 1..65535"),
        ("ock.mmc.meta_service_url = tcp://h", "got 'tcp://h'"),
        ("ock.mmc.meta.lease_ttl_ms = 0", "ock.mmc.meta.lease_ttl_ms (*:1): expected an integer >= 1, got '0'"),
        ("ock.mmc.meta.lease_ttl_ms = 30s", "got '30s'"),
        ("ock.mmc.meta.lease_ttl_ms = 86400001", "lease_ttl_ms: Input should be less than or equal to 86400000"),
        ("ock.mmc.local_service.world_size = -3", "ock.mmc.local_service.world_size (*:1): expected an integer >= 1"),
        ("ock.mmc.local_service.dram.size = ten", "ock.mmc.local_service.dram.size (*:1): expected a size like 10GB"),
        ("ock.mmc.local_service.dram.size = 1.5GB", "got '1.5GB'"),
        ("ock.mmc.local_service.dram.size = 0GB", "expected a size > 0"),
        ("ock.mmc.log_level = loud", "ock.mmc.log_level (*:1): expected one of debug, info"),
        ("just words", "*:1: expected 'key = value', got 'just words'"),
        ("= 5", "expected 'key = value'"),
        ("ock.mmc.log_level = info\nock.mmc.log_level = error", "*:2: ock.mmc.log_level is repeated (first at *:1)"),
    ],
)
def test_invalid_files_name_the_key(tmp_path, text, message):
    path = conf(tmp_path, text + "\n")
    with pytest.raises(ValueError) as info:
        build_config(meta_config=path, env={})
    assert message.replace("*", path) in str(info.value)


def test_meta_and_local_must_agree(tmp_path):
    """The pair rules (kvcore.config.mmc_files.mmc_pair) hold for the metastore's files too."""
    meta = conf(tmp_path, "ock.mmc.meta_service_url = tcp://a:1\n", "m.conf")
    local = conf(tmp_path, "ock.mmc.meta_service_url = tcp://b:1\n", "l.conf")
    with pytest.raises(ValueError, match=r"tcp://b:1 \(.*l.conf:1\) differs from .*tcp://a:1 \(.*m.conf:1\)"):
        build_config(meta_config=meta, local_config=local, env={})
    stores = conf(tmp_path, GUIDE_LOCAL.replace("127.0.0.2:6000", "127.0.0.3:6000"), "stores.conf")
    with pytest.raises(ValueError, match=r"config_store_url = tcp://127.0.0.3:6000 .* differs from .*127.0.0.2:6000"):
        build_config(meta_config=conf(tmp_path, GUIDE_META, "g.conf"), local_config=stores, env={})
    protocol = conf(tmp_path, GUIDE_LOCAL.replace("device_sdma", "pigeon"), "p.conf")
    with pytest.raises(ValueError, match=r"ock.mmc.local_service.protocol \(.*p.conf:4\): expected one of"):
        build_config(local_config=protocol, env={})


def test_missing_file_is_named(tmp_path):
    with pytest.raises(ValueError, match="cannot read conf file .*absent.conf"):
        build_config(env={"MMC_META_CONFIG_PATH": str(tmp_path / "absent.conf")})


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--port", "70000"], "port: Input should be less than or equal to 65535"),
        (["--world-size", "0"], "world_size: Input should be greater than or equal to 1"),
        (["--dram-size", "lots"], "--dram-size: expected a size like 10GB"),
        (["--log-level", "chatty"], "log_level: Input should be"),
        (["--heartbeat-timeout-ms", "0"], "heartbeat_timeout_ms"),
    ],
)
def test_invalid_flags_name_the_flag(argv, message):
    with pytest.raises(ValueError, match=message):
        config_from_args(argv)


def test_size_and_url_parsers():
    assert parse_size_bytes("10GB") == 10 * 2**30 and parse_size_bytes("7 B") == 7 and parse_size_bytes("2k") == 2048
    assert parse_url("tcp://10.0.0.1:5000", "k") == ("10.0.0.1", 5000)
    assert parse_url("http://[::1]:8000/", "k", ("http",)) == ("::1", 8000)
    for bad in ("tcp://:5000", "http://h:5000", "tcp://h:0", "tcp://h:70000"):
        with pytest.raises(ValueError, match="^k: expected tcp://HOST:PORT with a port in 1..65535"):
            parse_url(bad, "k")
