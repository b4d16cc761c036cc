"""``pdlink.memfabric`` against the real ``memfabric_hybrid==1.3.0`` (scripts/install-memcache).
Without an Ascend driver its config store still runs, but ``TransferEngine.initialize`` fails: the
adapter must raise memfabric's own reason (captured from its native log, which still reaches
stdout) and start nothing. A missing module names what to install. The read round trip (a prefill
registers memory, a decode reads rows of it) runs only where memfabric starts, and is skipped
elsewhere with the reason it gave."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from kvoffload_proto.v1 import transfer_pb2
from pdlink.engine_rows import EngineRows
from pdlink.memfabric import (
    MemfabricNotInstalled,
    MemfabricTransfer,
    native_reason,
)

DRIVER_FILES = ("/etc/ascend_install.info", "/usr/local/Ascend/driver/version.info")  # where hybm looks
DRIVER_REASON = [  # memfabric_hybrid 1.3.0's own ERROR lines on a host without an Ascend driver
    "check driver version failed, read version is empty, baseVer: V100R001C23SPC005B219 "
    "(HYBM hybm_gva_version.cpp:128)",
    "Failed to determine driver version (HYBM hybm_gva_version.cpp:203)",
    "the current version of ascend driver does not support mf! (HYBM hybm_entry.cpp:97)",
    "hybm core init failed: -1 (SMEM smem_trans.cpp:52)",
    "Failed to init smem_trans, ret=-1 (ADAPTER pytransfer.cpp:95)",
]


def without_ascend_driver() -> None:
    present = [p for p in DRIVER_FILES if os.path.exists(p)]
    if present:
        pytest.skip(f"an Ascend driver is installed here ({', '.join(present)}): this test needs a host without one")


def run_python(code: str, timeout: float = 120, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=timeout, **kw
    )


@pytest.mark.parametrize("role", ["Prefill", "Decode"])
def test_initialize_without_a_driver_raises_memfabrics_own_reason(role: str) -> None:
    """In a child process: hybm's native state is per process, and a memcache data path that failed
    earlier in the same process (libs/poolbackends' tests, on the same xdist worker) changes the lines
    memfabric logs next."""
    without_ascend_driver()
    proc = run_python(f"""
        import json
        from pdlink.memfabric import MemfabricTransfer, MemfabricUnavailable
        try:
            MemfabricTransfer.start({role!r}, "127.0.0.1", device_id=0, data_op="sdma")
        except MemfabricUnavailable as e:
            print("RESULT " + json.dumps({{"message": str(e), "code": e.code, "reason": e.reason,
                                          "needs_driver": e.needs_ascend_driver}}))
    """)
    line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
    assert line is not None, proc.stdout[-2000:] + proc.stderr[-2000:]
    result = json.loads(line[len("RESULT ") :])
    assert result["message"] == (
        "memfabric_hybrid cannot start here: TransferEngine.initialize(store_url='tcp://127.0.0.1', "
        f"session_id='127.0.0.1', role={role!r}, device_id=0, data_op_type=SDMA, store_server_role='Prefill') "
        f"returned -1; memfabric_hybrid says: {'; '.join(DRIVER_REASON)}; memfabric's data path needs an Ascend NPU "
        "driver (Ascend HDK) on this host; kvoffload does not fall back to its embedded P→D data path"
    )
    assert result["code"] == -1 and result["reason"] == "; ".join(DRIVER_REASON) and result["needs_driver"]
    # the native log, captured for the reason, is written back to stdout: nothing is lost
    assert "[HYBM hybm_entry.cpp:97 hybm_init] the current version of ascend driver does not support mf!" in proc.stdout
    assert "[ADAPTER pytransfer.cpp:95 Initialize] Failed to init smem_trans, ret=-1" in proc.stdout


def test_the_config_store_runs_here_and_the_engine_still_says_why_it_cannot() -> None:
    """The failure is the engine's (hybm needs the driver), not the config store's: a store started
    with ``create_config_store`` accepts connections on this host, and ``initialize`` next to it
    still fails with the driver reason. (A child process: a started store cannot be stopped.)"""
    without_ascend_driver()
    proc = run_python("""
        import json, socket
        import memfabric_hybrid as mf
        from pdlink.memfabric import MemfabricTransfer, MemfabricUnavailable
        sock = socket.socket(); sock.bind(("127.0.0.1", 0)); port = sock.getsockname()[1]; sock.close()
        rc = mf.create_config_store(f"tcp://127.0.0.1:{port}")
        socket.create_connection(("127.0.0.1", port), timeout=5).close()  # ConnectionRefusedError if not
        answers = True
        try:
            MemfabricTransfer.start("Prefill", "127.0.0.1")
        except MemfabricUnavailable as e:
            print("RESULT " + json.dumps({"rc": rc, "answers": answers, "code": e.code, "reason": e.reason}))
    """)
    line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
    assert line is not None, proc.stdout[-2000:] + proc.stderr[-2000:]
    result = json.loads(line[len("RESULT ") :])
    # the store's own log line about our probe connection ("Failed to read header from the socket
    # connected from ...") lands whenever its thread gets to it (first here, last on a busy CI machine);
    # without it, the engine's driver lines end the reason, every one in order
    reason = result.pop("reason")
    assert result == {"rc": 0, "answers": True, "code": -1}
    parts = [p for p in reason.split("; ") if not p.startswith("Failed to read header from the socket connected")]
    assert parts[-len(DRIVER_REASON) :] == list(DRIVER_REASON), reason


def test_a_missing_module_names_what_to_install() -> None:
    proc = run_python("""
        import sys
        sys.modules["memfabric_hybrid"] = None  # hidden: `import memfabric_hybrid` raises ImportError
        from pdlink.memfabric import MemfabricNotInstalled, MemfabricTransfer
        try:
            MemfabricTransfer.start("Decode", "127.0.0.1")
        except MemfabricNotInstalled as e:
            print("RESULT", e)
    """)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == (
        "RESULT cannot import memfabric_hybrid (ModuleNotFoundError: import of memfabric_hybrid halted; None in "
        "sys.modules); install MemFabric: scripts/install-memcache (it runs `pip install memfabric_hybrid==1.3.0`)"
    )
    assert issubclass(MemfabricNotInstalled, ImportError)


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        ({"role": "Producer"}, "role must be one of ('Prefill', 'Decode'), got 'Producer'"),
        ({"device_id": -1}, "device_id must be an int >= 0, got -1"),
        ({"device_id": True}, "device_id must be an int >= 0, got True"),
        (
            {"data_op": "rdma"},
            "data_op must be one of ('sdma', 'host_rdma', 'device_rdma', 'device_urma', 'device_uboe'), got 'rdma'",
        ),
        ({"host": ""}, "host must be the address peers reach this process at, got ''"),
    ],
)
def test_bad_arguments_are_refused_before_memfabric_is_called(kw: dict, message: str) -> None:
    args = {"role": "Prefill", "host": "127.0.0.1", **kw}
    with pytest.raises(ValueError) as info:
        MemfabricTransfer.start(args.pop("role"), args.pop("host"), **args)
    assert str(info.value) == message


def test_native_reason_keeps_the_first_error_of_each_source_line() -> None:
    lines = [
        "2026-12-01 11:18:56.586053 WARN [1-1][HYBM a.cpp:47 F] driver version path is not a valid real path:/x",
        "2026-12-01 11:18:56.586121 ERROR [1-1][HYBM b.cpp:128 G] check failed, baseVer: 1",
        "2026-12-01 11:18:56.586131 ERROR [1-1][HYBM b.cpp:128 G] check failed, baseVer: 2",
        "unrelated output",
        "2026-12-01 11:18:56.586212 ERROR [1-1][SMEM c.cpp:52 H] init failed: -1",
    ]
    assert native_reason(lines) == "check failed, baseVer: 1 (HYBM b.cpp:128); init failed: -1 (SMEM c.cpp:52)"
    assert native_reason(lines[:1]) == ""


# ---- the data path (Ascend only) -----------------------------------------------------------------

PREFILL = """
    import sys, torch
    from pdlink.memfabric import MemfabricTransfer, MemfabricUnavailable
    try:
        transfer = MemfabricTransfer.start("Prefill", "127.0.0.1")
    except MemfabricUnavailable as e:
        print("UNAVAILABLE", e.reason, flush=True)
        sys.exit(0)
    rows = torch.arange(256 * 64, dtype=torch.int64).to(torch.uint8)  # 256 rows x 64 bytes, a known pattern
    transfer.register(rows.data_ptr(), rows.numel())
    print("READY", transfer.session, rows.data_ptr(), flush=True)
    sys.stdin.read()  # until the test is done
    transfer.close()
"""


def test_a_decode_reads_rows_a_prefill_registered() -> None:
    child = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(PREFILL)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        line = next((x for x in child.stdout if x.startswith(("READY ", "UNAVAILABLE "))), "")
        if line.startswith("UNAVAILABLE "):
            reason = line.split(" ", 1)[1].strip()
            assert "driver" in reason.lower(), f"memfabric cannot start here, and not for want of a driver: {reason}"
            pytest.skip(f"memfabric's data path needs an Ascend driver: {reason}")
        assert line.startswith("READY "), f"the prefill child exited with {child.wait()}"
        _, session, address = line.split()
        rows = EngineRows(MemfabricTransfer.start("Decode", "127.0.0.1"), 16 * 64)
        try:
            meta = transfer_pb2.LayoutMetadata(engine_session=session, engine_segment_address=int(address))
            region = transfer_pb2.BufferRegion(
                segment_name="rows", offset_bytes=0, row_stride_bytes=64, capacity_tokens=256
            )
            (got,) = rows.layer_rows(meta, 3, 10, [(region, 64)])
            want = torch.arange(256 * 64, dtype=torch.int64).to(torch.uint8).view(256, 64)[3:10]
            assert torch.equal(got, want)
            with pytest.raises(ValueError, match="staging buffer holds 1024"):
                rows.layer_rows(meta, 0, 17, [(region, 64)])
        finally:
            rows.close()
    finally:
        child.stdin.close()
        child.wait(timeout=30)
