"""transfer_backend "memfabric" in the services, on a host without an Ascend driver: a decode and a
prefill started with it (as subprocesses, the real memfabric_hybrid 1.3.0) exit 2 at once with one
line naming memfabric's own reason, and never serve on the embedded data path instead. Also the
decode's other half of "never substituted": a decode on the embedded path refuses the layout of a
prefill that announces a memfabric session (and the reverse is the same check)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dsamodel.presets import tiny_model
from kvcore.layout import dtype_name
from kvoffload_decode.transfer import decode_transfer
from kvoffload_engine.model_layout import kv_layout
from kvoffload_proto.v1 import transfer_pb2 as pb
from kvoffload_testing.connector_configs import (
    decode_additional_config,
    decode_kv_transfer_config,
    prefill_kv_transfer_config,
)

DRIVER_FILES = ("/etc/ascend_install.info", "/usr/local/Ascend/driver/version.info")  # where memfabric looks
START_TIMEOUT_S = 120  # the service must have exited by then (model load included)
DRIVER_REASON = "the current version of ascend driver does not support mf! (HYBM hybm_entry.cpp:97)"


def memfabric(kv_json: str) -> str:
    """The config with every SfaRemoteD2HConnector's transfer_backend set to "memfabric"."""
    kv = json.loads(kv_json)
    for conn in kv["kv_connector_extra_config"].get("connectors", [kv]):
        if conn["kv_connector"] == "SfaRemoteD2HConnector":
            conn["kv_connector_extra_config"]["transfer_backend"] = "memfabric"
    return json.dumps(kv)


def start(service: str, args: list[str]) -> tuple[subprocess.CompletedProcess, float]:
    t = time.monotonic()
    proc = subprocess.run(
        [str(Path(sys.executable).with_name(service)), *args],
        capture_output=True,
        text=True,
        timeout=START_TIMEOUT_S,
        stdin=subprocess.DEVNULL,
    )
    return proc, time.monotonic() - t


@pytest.mark.parametrize("service", ["kvoffload-prefill", "kvoffload-decode"])
def test_a_service_with_transfer_backend_memfabric_exits_2_with_memfabrics_reason(model_dir, service):
    present = [p for p in DRIVER_FILES if os.path.exists(p)]
    if present:
        pytest.skip(f"an Ascend driver is installed here ({', '.join(present)}): memfabric may start")
    common = ["--model", str(model_dir), "--port", "1", "--max-model-len", "256"]
    if service == "kvoffload-prefill":
        args = [*common, "--kv-transfer-config", memfabric(prefill_kv_transfer_config(20050))]
    else:
        args = [
            *common,
            "--kv-transfer-config",
            memfabric(decode_kv_transfer_config(20050)),
            "--additional-config",
            decode_additional_config(),
        ]
    proc, took = start(service, args)
    assert proc.returncode == 2, proc.stderr[-3000:]
    lines = [x for x in proc.stderr.splitlines() if x.startswith(f"{service}: ")]
    assert len(lines) == 1, proc.stderr[-3000:]
    role = "Prefill" if service == "kvoffload-prefill" else "Decode"
    assert lines[0].startswith(
        f"{service}: transfer_backend 'memfabric': memfabric_hybrid cannot start here: TransferEngine.initialize("
        f"store_url='tcp://127.0.0.1', session_id='127.0.0.1', role={role!r}, device_id=0, data_op_type=SDMA, "
        "store_server_role='Prefill') returned -1; memfabric_hybrid says: check driver version failed"
    ), lines[0]
    assert DRIVER_REASON in lines[0] and "hybm core init failed: -1" in lines[0]
    assert lines[0].endswith("kvoffload does not fall back to its embedded P→D data path")
    assert "serving" not in proc.stderr + proc.stdout  # no "serving" log line: nothing started instead
    assert took < START_TIMEOUT_S


def _layout_of_a_prefill(layout, memfabric_session: str) -> pb.LayoutMetadata:
    layers = [
        pb.LayerLayout(
            layer=s.index,
            main_row_bytes=s.main.row_bytes,
            main_dtype=dtype_name(s.main.dtype),
            indexer_row_bytes=s.indexer.row_bytes,
            indexer_dtype=dtype_name(s.indexer.dtype),
        )
        for s in layout.layers
    ]
    return pb.LayoutMetadata(
        model_id="tiny",
        num_layers=len(layers),
        block_size=layout.block_size,
        layers=layers,
        prefill_tp_size=1,
        data_endpoint="10.0.0.1:7000",
        host_id="decode-host",
        layout_version=5,
        transfer_engine="memfabric" if memfabric_session else "",
        engine_session=memfabric_session,
        engine_segment_address=4096 if memfabric_session else 0,
    )


def test_an_embedded_decode_refuses_a_memfabric_prefills_layout():
    model = tiny_model(dtype="float32")
    layout = kv_layout(model.config, 16, model.dtype)
    transfer = decode_transfer(None, layout, "tiny", "decode-host")
    try:
        ack = transfer.ExchangeLayout(_layout_of_a_prefill(layout, "10.0.0.1:9000"), None)
        assert not ack.accepted and ack.reason == (
            "transfer_engine: the prefill's transfer_backend is 'memfabric' (session 10.0.0.1:9000), this "
            "decode's 'kvoffload'; both sides must use the same one"
        )
        assert transfer.consumer.layouts() == {}
        ack = transfer.ExchangeLayout(_layout_of_a_prefill(layout, ""), None)
        assert ack.accepted and ack.shared_memory  # the same prefill on the embedded path: shared memory
    finally:
        transfer.close()
