"""The ``memcache`` backend against the real ``memcache_hybrid==1.3.0`` (scripts/install-memcache):
the MetaService launcher (a real process, on loopback), the conf files, and ``MemcacheHostPool``.
Its data path needs an Ascend driver: on a host without one, construction must raise the library's
own reason and build nothing (never the embedded pool); the round trip runs only where it starts,
and is skipped elsewhere with the reason the probe got from this host."""

from __future__ import annotations

import glob
import os
import socket
import time

import pytest
import torch

from kvcore import backends
from kvcore.pool.geometry import PoolGeometry
from kvcore.pool.segment import SharedSegment
from poolbackends.memcache import MemcacheHostPool, dram_bytes_for
from poolbackends.memcache_client import MemcacheClient, MemcacheUnavailable, native_reason
from poolbackends.memcache_conf import LOCAL_KEYS, LocalSettings, local_fields, meta_urls
from poolbackends.memcache_meta import MemcacheMetaError, MemcacheMetaService, MetaSettings
from svcruntime.serverprocess import free_port, port_answers

ROWS = (16, 8)
DRIVER_FILES = ("/etc/ascend_install.info", "/usr/local/Ascend/driver/version.info")  # where hybm looks


def geo(num_blocks: int = 8) -> PoolGeometry:
    return PoolGeometry(4, ROWS, num_blocks)


def data(seed: int, plane: int, n: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed * 10 + plane)
    return torch.randint(0, 256, (n, 4, ROWS[plane]), dtype=torch.uint8, generator=g)


def memcache_segments() -> set[str]:
    return set(glob.glob(SharedSegment.path_for("memcache-x")[:-1] + "*"))


def listens_on_loopback_only(port: int) -> bool:
    with open("/proc/net/tcp") as f:
        rows = [line.split() for line in f.readlines()[1:]]
    local = [r[1] for r in rows if r[3] == "0A" and int(r[1].split(":")[1], 16) == port]  # 0A: LISTEN
    return bool(local) and all(a.split(":")[0] == "0100007F" for a in local)


def settings_for(meta: MemcacheMetaService, protocol: str = "host_shm") -> LocalSettings:
    return LocalSettings(
        meta_service_url=meta.meta_service_url,
        config_store_url=meta.config_store_url,
        dram_bytes=dram_bytes_for(geo()),
        protocol=protocol,
        world_size=8,
        client_timeout_s=10,
    )


def without_ascend_driver() -> None:
    present = [p for p in DRIVER_FILES if os.path.exists(p)]
    if present:
        pytest.skip(f"an Ascend driver is installed here ({', '.join(present)}): this test needs a host without one")


@pytest.fixture(scope="module")
def meta():
    with MemcacheMetaService.start(MetaSettings()) as m:
        yield m


# ---- the MetaService ------------------------------------------------------------------------------


def test_meta_service_starts_on_loopback_answers_and_stops():
    m = MemcacheMetaService.start(MetaSettings(lease_ttl_ms=5000))
    try:
        assert m.running and m.answers()
        assert m.health()["service_ready"] is True
        for port in (m.urls.port, m.urls.config_store_port, m.urls.metrics_port):
            assert listens_on_loopback_only(port), port
        conf = open(m.conf_path).read()
        for key in (
            "ock.mmc.meta_service_url",
            "ock.mmc.meta_service.config_store_url",
            "ock.mmc.meta_service.metrics_url",
            "ock.mmc.meta.lease_ttl_ms = 5000",
        ):
            assert key in conf
        # a real RPC: a metadata-only client (no memory, so no Ascend driver needed) asks for keys
        with MemcacheClient.connect(settings_for(m), contribute_memory=False) as c:
            assert c.exists(["kvoffload/00", "kvoffload/01"]) == [0, 0]
    finally:
        m.stop(keep_logs=True)
    assert not m.running
    assert not port_answers("127.0.0.1", m.urls.port, 0.2)
    assert "Meta Service launched successfully" in m.log_tail(200_000)
    m.stop()
    assert not os.path.exists(m.log_dir)


def test_meta_service_from_given_conf(tmp_path):
    ports = [free_port("127.0.0.1") for _ in range(3)]
    conf = tmp_path / "mmc-meta.conf"
    conf.write_text(
        f"ock.mmc.meta_service_url = tcp://127.0.0.1:{ports[0]}\n"
        f"ock.mmc.meta_service.config_store_url = tcp://127.0.0.1:{ports[1]}\n"
        f"ock.mmc.meta_service.metrics_url = http://127.0.0.1:{ports[2]}\n"
        f"ock.mmc.meta.lease_ttl_ms = 30000\nock.mmc.log_level = error\n"
        f"ock.mmc.log_path = {tmp_path}\n"
    )
    with MemcacheMetaService.start(MetaSettings(meta_config=str(conf))) as m:
        assert m.meta_service_url == f"tcp://127.0.0.1:{ports[0]}" and m.answers()
        assert m.config_store_url == f"tcp://127.0.0.1:{ports[1]}"


def test_meta_service_port_taken_is_a_clear_error():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        with pytest.raises(MemcacheMetaError, match=f"RPC port 127.0.0.1:{port} is taken"):
            MemcacheMetaService.start(MetaSettings(port=port))


# ---- conf files -----------------------------------------------------------------------------------


def test_local_conf_keys_and_errors(tmp_path):
    s = LocalSettings(
        meta_service_url="tcp://127.0.0.1:5000",
        config_store_url="tcp://127.0.0.1:6000",
        dram_bytes=(10 << 30) + 1,
        log_level="warning",
    )
    path = tmp_path / "mmc-local.conf"
    path.write_text(s.conf_text())
    fields = local_fields(path)
    assert fields["dram_size"] == "10241MB" and fields["protocol"] == "device_sdma"
    assert fields["log_level"] == "warn" and fields["world_size"] == 256
    assert set(fields) <= {f for f, _ in LOCAL_KEYS.values()}
    path.write_text("ock.mmc.meta_service_url = tcp://127.0.0.1:5000\nock.mmc.log_path = /tmp\n")
    with pytest.raises(ValueError, match=r"ock.mmc.log_path \(.*mmc-local.conf:2\): not a LocalService key"):
        local_fields(path)
    path.write_text("ock.mmc.local_service.protocol = carrier_pigeon\n")
    with pytest.raises(ValueError, match="expected one of host_rdma"):
        local_fields(path)
    meta = tmp_path / "mmc-meta.conf"
    meta.write_text("ock.mmc.meta_service_url = tcp://127.0.0.1:7000\n")
    u = meta_urls(meta)
    assert (u.port, u.config_store_port, u.metrics_port) == (7000, 6000, 8000)


def test_native_reason_keeps_errors_and_driver_warnings():
    lines = [
        "2026 WARN [1-1][HYBM v.cpp:47 Load] driver version path is not a valid real path:/x",
        "2026 WARN [1-1][SMEM a.cpp:1 F] something else",
        "2026 ERROR [1-1][HYBM hybm_entry.cpp:97 hybm_init] the current version of ascend driver does not support mf!",
        "2026 ERROR [1-1][HYBM hybm_entry.cpp:97 hybm_init] the current version of ascend driver does not support mf!",
    ]
    assert native_reason(lines) == (
        "driver version path is not a valid real path:/x (HYBM v.cpp:47); the current "
        "version of ascend driver does not support mf! (HYBM hybm_entry.cpp:97)"
    )


# ---- the pool: a host with the module but no usable device ---------------------------------------


@pytest.mark.parametrize("protocol", ["host_shm", "device_sdma"])
def test_pool_construction_names_the_cause_here(meta, protocol):
    without_ascend_driver()
    before = memcache_segments()
    with pytest.raises(MemcacheUnavailable) as info:
        MemcacheHostPool.connect(geo(), settings=settings_for(meta, protocol))
    e = info.value
    msg = str(e)
    assert "memcache_hybrid cannot start its LocalService here" in msg
    assert f"DistributedObjectStore.init(device_id=0, init_bm=True) returned {e.code}" in msg and e.code != 0
    assert f"protocol {protocol}" in msg and meta.meta_service_url in msg
    assert "the current version of ascend driver does not support mf!" in e.reason  # the library's own words
    assert e.needs_ascend_driver and "needs an Ascend NPU driver" in msg
    assert "does not fall back to its embedded pool" in msg
    assert memcache_segments() == before  # nothing built: no segment, no embedded pool


def test_module_without_device_gets_the_error_never_the_embedded_pool(meta, tmp_path):
    """This host: memcache_hybrid imports, no NPU. The availability check passes (the module is
    here), and the adapter, given the seed's mmc-local.conf, raises instead of returning any pool."""
    without_ascend_driver()
    import memcache_hybrid  # noqa: F401  - the module is here

    assert backends.backend_problem("memcache") is None  # the adapter's construction is the judge
    conf = tmp_path / "mmc-local.conf"
    conf.write_text(
        f"ock.mmc.meta_service_url = {meta.meta_service_url}\n"
        f"ock.mmc.local_service.config_store_url = {meta.config_store_url}\n"
        f"ock.mmc.log_level = info\nock.mmc.local_service.world_size = 256\n"
        f"ock.mmc.local_service.protocol = device_sdma\nock.mmc.local_service.dram.size = 64MB\n"
    )
    before = memcache_segments()
    built = None
    with pytest.raises(MemcacheUnavailable, match="ascend driver does not support mf") as info:
        built = MemcacheHostPool.connect(geo(), local_config=str(conf))
    assert built is None and f"conf {conf}" in str(info.value)
    assert memcache_segments() == before


def test_a_second_meta_service_in_one_process_is_refused_at_once(meta):
    """memcache_hybrid keeps one LocalService per process: once set up for ``meta`` (and its init
    failed), a connect to another MetaService would dial the first one's config store for minutes.
    It is refused at once, before any connection (one MetaService runs per host, so the other is
    only an address here)."""
    without_ascend_driver()
    with pytest.raises(MemcacheUnavailable):  # this process's LocalService: set up for ``meta``
        MemcacheClient.connect(settings_for(meta))
    other = LocalSettings(
        meta_service_url="tcp://127.0.0.1:1026",
        config_store_url="tcp://127.0.0.1:1027",
        dram_bytes=dram_bytes_for(geo()),
        protocol="host_shm",
    )
    started = time.monotonic()
    with pytest.raises(MemcacheUnavailable, match="already set up its LocalService") as info:
        MemcacheClient.connect(other)
    assert time.monotonic() - started < 2
    e = info.value
    assert meta.meta_service_url in e.reason and "tcp://127.0.0.1:1026" in str(e) and not e.needs_ascend_driver
    assert "another process" in str(e)


# ---- the data path (Ascend only) -----------------------------------------------------------------


def test_data_path_round_trip_across_pools(meta):
    """Not run here: put/get/exists/lease/remove through Memcache between two pools."""
    try:
        a = MemcacheHostPool.connect(geo(), settings=settings_for(meta), namespace="rt")
    except MemcacheUnavailable as e:
        if not e.needs_ascend_driver:
            raise
        pytest.skip(f"memcache data path needs an Ascend driver: {e.reason}")
    with a, MemcacheHostPool.connect(geo(), settings=settings_for(meta), namespace="rt") as b:
        keys = [b"k0", b"k1"]
        a.alloc(keys)
        for p in range(len(ROWS)):
            a.put_from(keys, p, data(1, p, 2))
        assert b.exists(keys) == [True, True]
        lease = b.lease(keys, 5000)
        out = torch.empty(2, 4, ROWS[1], dtype=torch.uint8)
        b.get_into(keys, 1, out)
        assert torch.equal(out, data(1, 1, 2))
        lease.release()
        a.remove([b"k0"])
        assert b.exists(keys) == [False, True]
