"""The kvoffload-metastore process: JSON logs, health SERVING once ready, graceful SIGTERM; bad config exits 2."""

import json
import queue
import signal
import subprocess
import sys
import threading

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvoffload_metastore.server import main


def _lines(stream, out: queue.Queue) -> None:
    for line in stream:
        out.put(line)


def _event(lines: queue.Queue, name: str, seen: list) -> dict:
    while True:
        record = json.loads(lines.get(timeout=30))  # every line is one JSON event
        seen.append(record)
        if record["event"] == name:
            return record


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=lambda s: s.name)
def test_process_serves_then_stops_gracefully(tmp_path, sig):
    conf = tmp_path / "mmc-meta.conf"
    conf.write_text("ock.mmc.meta.lease_ttl_ms = 1234\nock.mmc.meta_service.config_store_url = tcp://x:6000\n")
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvoffload_metastore", "--port", "0", "--grace-s", "1"],
        env={"MMC_META_CONFIG_PATH": str(conf), "PATH": "", "PYTHONFAULTHANDLER": "1"},
        stderr=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        text=True,
    )
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=_lines, args=(proc.stderr, lines), daemon=True).start()
    seen: list = []
    try:
        serving = _event(lines, "serving", seen)
        assert serving["lease_ttl_ms"] == 1234 and serving["level"] == "info" and "timestamp" in serving
        assert any("ignored by the embedded backend" in r.get("note", "") for r in seen)
        with grpc.insecure_channel(f"127.0.0.1:{serving['port']}") as ch:
            reply = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
        proc.send_signal(sig)
        assert _exit_code(proc, lines, seen, sig) == 0
        stopped = _event(lines, "stopped", seen)
        assert stopped["released_pools"] == 0
        assert any(r["event"] == "signal received" and r["signal"] == sig.name for r in seen)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _exit_code(proc: subprocess.Popen, lines: queue.Queue, seen: list, sig: signal.Signals) -> int:
    """The process's exit code within 15 s of ``sig``; else a failure that quotes what it logged and,
    from SIGABRT (faulthandler, PYTHONFAULTHANDLER), where each of its threads stood."""
    try:
        return proc.wait(timeout=15)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGABRT)
        proc.wait(10)
        rest = []
        while not lines.empty():
            rest.append(lines.get())
        events = [r["event"] for r in seen]
        pytest.fail(f"no exit within 15 s of {sig.name}; events {events}, then:\n{''.join(rest)}")


def test_invalid_configuration_exits_2_naming_the_key(tmp_path, capsys, monkeypatch):
    conf = tmp_path / "bad.conf"
    conf.write_text("ock.mmc.local_service.world_size = many\n")
    monkeypatch.delenv("MMC_META_CONFIG_PATH", raising=False)
    monkeypatch.delenv("MMC_LOCAL_CONFIG_PATH", raising=False)
    assert main(["--local-config", str(conf)]) == 2
    err = capsys.readouterr().err
    assert "invalid configuration: ock.mmc.local_service.world_size" in err and "'many'" in err
