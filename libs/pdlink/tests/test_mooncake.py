"""``pdlink.mooncake_transfer`` against the real Mooncake Transfer Engine (``mooncake-transfer-engine-non-cuda``,
scripts/install-mooncake), over TCP on loopback, the prefill's engine in a child process: a decode
reads the rows the prefill registered, byte for byte, through ``EngineRows``; a read from a session
nobody serves, or of memory the prefill did not register, fails with the engine's error and leaves
the engine usable; bad arguments are refused
before any engine starts; the engine's glog error lines become the reason of a failed start-up."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch

from kvoffload_proto.v1 import transfer_pb2
from pdlink.engine_rows import EngineRows
from pdlink.mooncake_transfer import MooncakeError, MooncakeTransfer, native_reason

PREFILL = """
    import sys, torch
    from pdlink.mooncake_transfer import MooncakeTransfer
    transfer = MooncakeTransfer.start("127.0.0.1")
    rows = torch.arange(256 * 64, dtype=torch.int64).to(torch.uint8)  # 256 rows x 64 bytes, a known pattern
    transfer.register(rows.data_ptr(), rows.numel())
    print("READY", transfer.session, rows.data_ptr(), flush=True)
    sys.stdin.read()  # until the test is done
    transfer.close()
"""


@pytest.fixture(scope="module")
def prefill():
    """(session, address of the registered rows) of a prefill engine in a child process."""
    child = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(PREFILL)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        line = next((x for x in child.stdout if x.startswith("READY ")), "")
        assert line, f"the prefill child exited with {child.wait()}"
        _, session, address = line.split()
        yield session, int(address)
    finally:
        child.stdin.close()
        child.wait(timeout=30)


@pytest.fixture(scope="module")
def rows():
    engine_rows = EngineRows(MooncakeTransfer.start("127.0.0.1"), 16 * 64)
    yield engine_rows
    engine_rows.close()


REGION = transfer_pb2.BufferRegion(segment_name="rows", offset_bytes=0, row_stride_bytes=64, capacity_tokens=256)
WANT = torch.arange(256 * 64, dtype=torch.int64).to(torch.uint8).view(256, 64)


def test_a_decode_reads_rows_a_prefill_registered(prefill, rows) -> None:
    session, address = prefill
    meta = transfer_pb2.LayoutMetadata(
        transfer_engine="mooncake", engine_session=session, engine_segment_address=address
    )
    assert rows.name == "mooncake"
    (got,) = rows.layer_rows(meta, 3, 10, [(REGION, 64)])
    assert torch.equal(got, WANT[3:10])
    half = transfer_pb2.BufferRegion(
        segment_name="rows", offset_bytes=128 * 64, row_stride_bytes=32, capacity_tokens=256
    )
    a, b = rows.layer_rows(meta, 0, 4, [(REGION, 64), (half, 32)])  # two planes in one batched read
    assert torch.equal(a, WANT[:4]) and torch.equal(b, WANT[128:130].reshape(4, 32))
    with pytest.raises(ValueError, match="the mooncake staging buffer holds 1024"):
        rows.layer_rows(meta, 0, 17, [(REGION, 64)])
    with pytest.raises(ValueError, match="names no engine_session"):
        rows.layer_rows(transfer_pb2.LayoutMetadata(), 0, 1, [(REGION, 64)])


def test_a_read_from_a_session_nobody_serves_fails_and_the_engine_reads_on(prefill, rows) -> None:
    session, address = prefill
    dead = transfer_pb2.LayoutMetadata(engine_session="127.0.0.1:1", engine_segment_address=address)
    with pytest.raises(
        MooncakeError, match=r"batch_transfer_sync_read from session 127\.0\.0\.1:1 \(1 ranges, 64 bytes\)"
    ):
        rows.layer_rows(dead, 0, 1, [(REGION, 64)])
    meta = transfer_pb2.LayoutMetadata(engine_session=session, engine_segment_address=address)
    (got,) = rows.layer_rows(meta, 255, 256, [(REGION, 64)])
    assert torch.equal(got, WANT[255:])


def test_the_peer_refuses_a_read_of_memory_it_did_not_register(prefill, rows) -> None:
    """The prefill's engine checks every range against what it registered: addresses from a stale
    layout (a restarted prefill's old buffers) fail the read, they never read other bytes."""
    session, address = prefill
    beyond = transfer_pb2.LayoutMetadata(engine_session=session, engine_segment_address=address + 256 * 64)
    with pytest.raises(MooncakeError, match="returned -1"):
        rows.layer_rows(beyond, 0, 1, [(REGION, 64)])  # the 64 bytes after the registered rows
    (got,) = rows.layer_rows(
        transfer_pb2.LayoutMetadata(engine_session=session, engine_segment_address=address), 0, 1, [(REGION, 64)]
    )
    assert torch.equal(got, WANT[:1])  # and the engine reads on


@pytest.mark.parametrize("host", ["", " 127.0.0.1", "[::1]", "127.0.0.1:9000", "0.0.0.0", None])
def test_a_bad_host_is_refused_before_any_engine_starts(host) -> None:
    with pytest.raises(ValueError, match="host must be"):
        MooncakeTransfer.start(host)


def test_register_and_read_check_their_arguments(rows) -> None:
    with pytest.raises(ValueError, match="an address and a size > 0"):
        rows.transfer.register(0, 16)
    with pytest.raises(ValueError, match="as many local addresses"):
        rows.transfer.read("127.0.0.1:1", [1, 2], [1], [1])


def test_the_engines_error_lines_are_its_reason() -> None:
    lines = [
        "I1203 18:47:11.100000  4742 transfer_engine.cpp:10] Transfer Engine starting",
        "E1203 18:47:11.113956  4742 transfer_metadata.cpp:1098] Local segment descriptor not found",
        "E1203 18:47:11.113999  4742 transfer_metadata.cpp:1098] Local segment descriptor not found",
        "E1203 18:47:11.147917  4742 transfer_metadata_plugin.cpp:1030] connect()127.0.0.1:1: Connection refused [111]",
    ]
    assert native_reason(lines) == (
        "Local segment descriptor not found (transfer_metadata.cpp:1098); "
        "connect()127.0.0.1:1: Connection refused [111] (transfer_metadata_plugin.cpp:1030)"
    )
    assert native_reason(lines[:1]) == ""
