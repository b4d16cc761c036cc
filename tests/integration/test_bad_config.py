"""Bad input, table-driven: every row is one invalid configuration a user can write, where it goes
(prefill / decode ``--kv-transfer-config``, ``--additional-config``, ``mmc-meta.conf`` /
``mmc-local.conf``, the flags of every service) and the EXACT error it gets. ``{dir}`` in an expected
message stands for the row's temporary folder (the conf files live there). The table is
``bad_config_rows.ROWS`` and the valid baselines its rows break are in ``bad_config_baselines`` (both in
tests/integration/support).

Most rows call the parsing entry points the services call (fast); ``test_console_script_*`` run the
real console scripts as subprocesses and check that they exit non-zero with the message on stderr,
within a timeout, having started nothing.
"""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from bad_config_baselines import (
    D2H,
    D2H_P,
    DECODE_KV,
    DECODE_SIZES,
    LAYOUT,
    PREFILL_KV,
    PROXY_BACKENDS,
    SP,
    SPARSE,
    STORE,
    STORE_P,
    WILDCARD,
    Row,
    edit,
)
from bad_config_rows import ROWS

from kvcore.config.decode_settings import decode_settings
from kvcore.config.errors import ConfigError
from kvcore.config.prefill_settings import prefill_settings
from kvoffload_decode.server import main as decode_main
from kvoffload_metastore.config import build_config
from kvoffload_metastore.server import config_from_args
from kvoffload_prefill.server import main as prefill_main
from kvoffload_proxy.config import parse_args

# ---- how each row is fed to its entry point -----------------------------------------------------


def _write(tmp: Path, name: str, text: str) -> str:
    path = tmp / name
    path.write_text(text)
    return str(path)


def apply(row: Row, tmp: Path) -> None:
    """Feed ``row.input`` to the entry point of ``row.where`` (raises its error)."""
    where, value = row.where, row.input
    if where == "prefill kv-transfer-config":
        prefill_settings(value, None, LAYOUT)
    elif where == "prefill additional-config":
        prefill_settings(json.dumps(PREFILL_KV), value, LAYOUT)
    elif where == "decode kv-transfer-config":
        decode_settings(value, json.dumps(SPARSE), LAYOUT, **DECODE_SIZES)
    elif where == "decode additional-config":
        decode_settings(json.dumps(DECODE_KV), value, LAYOUT, **DECODE_SIZES)
    elif where == "decode sizes":
        sizes = {k: v for k, v in value.items() if k != "kv"}
        decode_settings(value.get("kv", json.dumps(DECODE_KV)), json.dumps(SPARSE), LAYOUT, **{**DECODE_SIZES, **sizes})
    elif where == "mmc meta conf":
        build_config(meta_config=_write(tmp, "mmc-meta.conf", value), env={})
    elif where == "mmc local conf":
        build_config(local_config=_write(tmp, "mmc-local.conf", value), env={})
    elif where == "mmc meta+local conf":
        build_config(
            meta_config=_write(tmp, "mmc-meta.conf", value[0]),
            local_config=_write(tmp, "mmc-local.conf", value[1]),
            env={},
        )
    elif where == "mmc conf env":
        build_config(env={k: v.format(dir=tmp) for k, v in value.items()})
    elif where == "metastore flags":
        config_from_args(value)
    elif where == "proxy flags":
        parse_args(value)
    else:
        raise AssertionError(f"unknown where {where!r}")


def test_the_table_is_large_and_covers_every_input():
    assert len(ROWS) >= 40
    assert len({(r.where, r.id) for r in ROWS}) == len(ROWS)
    assert {r.where for r in ROWS} >= {
        "prefill kv-transfer-config",
        "decode kv-transfer-config",
        "decode additional-config",
        "mmc meta conf",
        "mmc local conf",
        "metastore flags",
        "proxy flags",
        "decode flags",
        "prefill flags",
    }


SERVICE_MAINS = {
    "decode flags": ("kvoffload-decode", decode_main),
    "prefill flags": ("kvoffload-prefill", prefill_main),
}


@pytest.mark.parametrize("row", ROWS, ids=[f"{r.where.replace(' ', '_')}:{r.id}" for r in ROWS])
def test_invalid_configuration_gets_its_exact_error(row: Row, tmp_path: Path, capsys):
    if row.where in SERVICE_MAINS:  # the service's own main: exit status 2, the message on stderr
        service, main = SERVICE_MAINS[row.where]
        argv = ["--model", str(tmp_path / "not-loaded"), "--kv-transfer-config", "{}", *row.input]
        assert main(argv) == 2
        assert f"{service}: {row.error}" in capsys.readouterr().err.splitlines()
        return
    with pytest.raises(ValueError) as info:  # ConfigError is a ValueError; so are the metastore's and proxy's
        apply(row, tmp_path)
    if row.where.startswith(("prefill", "decode")):
        assert isinstance(info.value, ConfigError)
    assert str(info.value) == row.error.format(dir=tmp_path)


def test_config_error_lists_every_problem_separately():
    bad = edit(PREFILL_KV, (D2H + ("kv_port",), 0), (STORE + ("layerwise_num_shared_buffers",), 0))
    with pytest.raises(ConfigError) as info:
        prefill_settings(bad, edit(SPARSE, (SP + ("enabled",), "yes")), LAYOUT)
    assert len(info.value.errors) == 3  # two in the kv-transfer-config, one in the additional-config
    assert [e.split(":")[0] for e in info.value.errors] == [
        f"{D2H_P}.kv_port",
        f"{STORE_P}.layerwise_num_shared_buffers",
        "sparse_kv_offload_config.enabled",
    ]
    assert str(info.value) == "; ".join(info.value.errors)


def test_the_baselines_are_valid():
    """Every row fails because of its one change, not because the baseline is broken."""
    prefill_settings(json.dumps(PREFILL_KV), None, LAYOUT)
    decode_settings(json.dumps(DECODE_KV), json.dumps(SPARSE), LAYOUT, **DECODE_SIZES)
    parse_args(PROXY_BACKENDS)
    build_config(env={})


# ---- the real console scripts -------------------------------------------------------------------

BIN = Path(sys.executable).parent
SCRIPT_TIMEOUT_S = 120


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> str:
    from dsamodel.presets import write_tiny

    return str(write_tiny(tmp_path_factory.mktemp("tiny") / "tiny"))


def run_script(name: str, args: list[str], env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    script = BIN / name
    assert script.exists(), f"{script} is not installed (run scripts/bootstrap)"
    environ = {k: v for k, v in os.environ.items() if not k.startswith("MMC_")}
    return subprocess.run(
        [str(script), *args],
        capture_output=True,
        text=True,
        timeout=SCRIPT_TIMEOUT_S,
        env={**environ, **(env or {})},
        stdin=subprocess.DEVNULL,
    )


def test_console_script_metastore_refuses_a_bad_conf_file(tmp_path):
    conf = _write(tmp_path, "mmc-meta.conf", "ock.mmc.meta.lease_ttl_ms = 30s\n")
    proc = run_script("kvoffload-metastore", ["--port", "0"], env={"MMC_META_CONFIG_PATH": conf})
    assert proc.returncode == 2
    assert (
        f"kvoffload-metastore: invalid configuration: ock.mmc.meta.lease_ttl_ms ({conf}:1): "
        "expected an integer >= 1, got '30s'"
    ) in proc.stderr.splitlines()


def test_console_script_proxy_refuses_a_wildcard_host():
    proc = run_script("kvoffload-proxy", ["--host", "0.0.0.0", "--port", "1", *PROXY_BACKENDS])
    assert proc.returncode == 2
    assert f"kvoffload-proxy: error: --host '0.0.0.0' {WILDCARD}" in proc.stderr.splitlines()


def test_console_script_decode_refuses_a_store_connector(tiny_dir):
    kv = (
        '{"kv_connector": "AscendStoreConnector", "kv_role": "kv_consumer", '
        '"kv_connector_extra_config": {"backend": "kvoffload"}}'
    )
    proc = run_script(
        "kvoffload-decode",
        ["--model", tiny_dir, "--port", "1", "--kv-transfer-config", kv, "--additional-config", json.dumps(SPARSE)],
    )
    assert proc.returncode == 2
    assert (
        "kvoffload-decode: kv_connector: got 'AscendStoreConnector'; a decode node needs an "
        "SfaRemoteD2HConnector (alone or inside a MultiConnector)"
    ) in proc.stderr.splitlines()


def test_console_script_prefill_refuses_sparse_offload(tiny_dir):
    proc = run_script(
        "kvoffload-prefill",
        [
            "--model",
            tiny_dir,
            "--port",
            "1",
            "--kv-transfer-config",
            json.dumps(PREFILL_KV),
            "--additional-config",
            json.dumps(SPARSE),
        ],
    )
    assert proc.returncode == 2
    assert (
        "kvoffload-prefill: sparse_kv_offload_config.enabled: got True on a prefill (kv_producer) node; never "
        "enable sparse_kv_offload_config on prefill (only keep_device_kv_cache: true, a debug mode, allows it)"
    ) in proc.stderr.splitlines()


def test_console_script_prefill_refuses_a_bad_dram_size(tiny_dir, tmp_path):
    """The prefill sizes its pool from mmc-local.conf's dram.size (no --host-pool-gb): a bad value
    there is a start-up error naming the file, line and key."""
    conf = tmp_path / "mmc-local.conf"
    conf.write_text("ock.mmc.local_service.dram.size = 2.5GB\n")
    proc = run_script(
        "kvoffload-prefill",
        ["--model", tiny_dir, "--port", "1", "--kv-transfer-config", json.dumps(PREFILL_KV)],
        env={"MMC_LOCAL_CONFIG_PATH": str(conf)},
    )
    assert proc.returncode == 2
    assert (
        f"kvoffload-prefill: ock.mmc.local_service.dram.size ({conf}:1): expected a size like 10GB or 512MB, "
        f"got '2.5GB'"
    ) in proc.stderr.splitlines()


ASCEND_DRIVER_FILES = ("/etc/ascend_install.info", "/usr/local/Ascend/driver/version.info")  # where MemFabric looks


def test_console_script_prefill_on_memcache_without_an_ascend_driver_names_the_cause(tiny_dir, tmp_path):
    """backend 'memcache' against a real MetaService (started here): on a host with memcache_hybrid but
    no Ascend driver the LocalService cannot start, so the prefill exits 2 with the library's reason and
    the driver named, never runs the embedded pool, and leaves no shared-memory segment behind."""
    from kvcore.pool.segment import SharedSegment
    from poolbackends.memcache_meta import MemcacheMetaService, MetaSettings

    present = [p for p in ASCEND_DRIVER_FILES if os.path.exists(p)]
    if present:
        pytest.skip(f"an Ascend driver is installed here ({', '.join(present)}): this test needs a host without one")

    def segments() -> set[str]:  # the prefill's own segments and any Memcache pool's (others may run meanwhile)
        names = ("kvoffload-prefill-pool-x", "kvoffload-prefill-buffers-x", "memcache-x")
        return {p for n in names for p in glob.glob(SharedSegment.path_for(n)[:-1] + "*")}

    before = segments()
    kv = edit(PREFILL_KV, ((*STORE, "backend"), "memcache"))
    with MemcacheMetaService.start(MetaSettings()) as meta:
        conf = _write(
            tmp_path,
            "mmc-local.conf",
            f"ock.mmc.meta_service_url = {meta.meta_service_url}\n"
            f"ock.mmc.local_service.config_store_url = {meta.config_store_url}\n"
            "ock.mmc.local_service.protocol = device_sdma\nock.mmc.local_service.dram.size = 64MB\n",
        )
        proc = run_script(
            "kvoffload-prefill",
            ["--model", tiny_dir, "--port", "1", "--kv-transfer-config", kv, "--local-config", conf],
        )
        assert meta.running
    assert proc.returncode == 2, proc.stderr[-3000:]
    line = next(line for line in proc.stderr.splitlines() if line.startswith("kvoffload-prefill: "))
    assert line.startswith(
        "kvoffload-prefill: backend 'memcache': memcache_hybrid cannot start its LocalService "
        "here: DistributedObjectStore.init(device_id=0, init_bm=True) returned "
    ), line
    assert f"MetaService {meta.meta_service_url}, conf {conf}" in line
    assert "the current version of ascend driver does not support mf!" in line  # the library's own words
    assert "needs an Ascend NPU driver" in line and "does not fall back to its embedded pool" in line
    assert "serving" not in proc.stdout + proc.stderr
    assert segments() == before


def test_console_script_prefill_on_memcache_needs_its_local_conf(tiny_dir):
    kv = edit(PREFILL_KV, ((*STORE, "backend"), "memcache"))
    proc = run_script("kvoffload-prefill", ["--model", tiny_dir, "--port", "1", "--kv-transfer-config", kv])
    assert proc.returncode == 2
    assert (
        "kvoffload-prefill: backend 'memcache': needs the LocalService's mmc-local.conf (its "
        "ock.mmc.meta_service_url, ock.mmc.local_service.config_store_url, protocol and dram.size): give "
        "--local-config or set $MMC_LOCAL_CONFIG_PATH"
    ) in proc.stderr.splitlines(), proc.stderr[-2000:]
