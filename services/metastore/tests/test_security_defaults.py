"""Security defaults of the metastore: it binds 127.0.0.1 unless told otherwise, serves plain gRPC
without TLS flags, TLS with --tls-cert/--tls-key and mTLS with --tls-ca (svcruntime.tls).

The bind is checked on the running process: the listening TCP sockets it really holds, read from
/proc (its fd inodes matched against /proc/<pid>/net/tcp{,6}), not the parser's default."""

import os
import socket
import subprocess
import sys
import time

import pytest
from sockets import listening_sockets

from kvoffload_metastore.config import MetaStoreConfig
from kvoffload_metastore.server import config_from_args, main, start
from poolbackends.client import MetaStoreClient
from poolbackends.errors import MetaStoreUnavailable
from svcruntime.tls import TLSConfig


# tlscerts: a test-support module on the root pytest pythonpath
@pytest.fixture
def tlscerts():
    """The certificate helper (it needs cryptography, a test extra: missing, the TLS tests fail)."""
    import tlscerts

    return tlscerts


@pytest.fixture
def no_conf_env(monkeypatch):
    monkeypatch.delenv("MMC_META_CONFIG_PATH", raising=False)
    monkeypatch.delenv("MMC_LOCAL_CONFIG_PATH", raising=False)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_metastore(*args: str) -> tuple[subprocess.Popen, list[tuple[str, int]], int]:
    """``python -m kvoffload_metastore --port 0 --metrics-port P ARGS`` (no conf files): the process,
    its listening sockets once both ports are up, and the gRPC port."""
    metrics_port = _free_port()
    env = {k: v for k, v in os.environ.items() if k not in ("MMC_META_CONFIG_PATH", "MMC_LOCAL_CONFIG_PATH")}
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvoffload_metastore", "--port", "0", "--metrics-port", str(metrics_port), *args],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    deadline = time.monotonic() + 30
    try:
        while True:
            if proc.poll() is not None:
                raise AssertionError(f"the metastore exited with {proc.returncode}: {proc.stderr.read()[-2000:]!r}")
            sockets = listening_sockets(proc.pid)
            grpc_ports = {port for _, port in sockets if port != metrics_port}
            if metrics_port in {port for _, port in sockets} and grpc_ports:
                assert len(grpc_ports) == 1, sockets
                return proc, sockets, grpc_ports.pop()
            assert time.monotonic() < deadline, f"the metastore never listened on two ports: {sockets}"
            time.sleep(0.1)
    except BaseException:
        stop_metastore(proc)
        raise


def stop_metastore(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    proc.stderr.close()


def test_binds_loopback_and_plain_by_default(no_conf_env):
    """Started with no --host and no TLS flags: every socket it listens on (gRPC and /metrics) is
    on 127.0.0.1 — none on 0.0.0.0 or :: — and a plain-gRPC client gets an answer."""
    proc, sockets, grpc_port = start_metastore()
    try:
        assert len(sockets) >= 2 and all(addr == "127.0.0.1" for addr, _ in sockets), sockets
        with MetaStoreClient(f"127.0.0.1:{grpc_port}", tls=None, timeout_s=5) as plain:
            assert plain.stats().capacity_bytes == 0  # an answer over plain gRPC
    finally:
        stop_metastore(proc)


def test_the_socket_check_sees_a_wildcard_bind(no_conf_env):
    """The check above can fail: told --host 0.0.0.0, the same process shows wildcard sockets
    (0.0.0.0, or :: where a server opens a dual-stack socket for it)."""
    proc, sockets, _ = start_metastore("--host", "0.0.0.0")
    try:
        assert len(sockets) >= 2 and all(addr in ("0.0.0.0", "::") for addr, _ in sockets), sockets
    finally:
        stop_metastore(proc)


def test_tls_flags_load(no_conf_env, tmp_path, tlscerts):
    pki = tlscerts.make_pki(tmp_path)
    config, _ = config_from_args(["--tls-cert", str(pki.cert), "--tls-key", str(pki.key), "--tls-ca", str(pki.ca)])
    assert config.tls.mutual and config.tls.cert_path == str(pki.cert)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--tls-key", "k.pem"], "--tls-key given without --tls-cert"),
        (["--tls-ca", "CA"], "--tls-ca given without --tls-cert/--tls-key: kvoffload-metastore serves gRPC"),
        (
            ["--tls-cert", "/nonexistent/c.pem", "--tls-key", "/nonexistent/k.pem"],
            "--tls-cert /nonexistent/c.pem: cannot read",
        ),
    ],
)
def test_bad_tls_flags_exit_2_naming_the_flag(no_conf_env, capsys, tmp_path, tlscerts, argv, message):
    if argv[-1] == "CA":
        argv = ["--tls-ca", str(tlscerts.make_pki(tmp_path).ca)]
    assert main(argv) == 2
    assert message in capsys.readouterr().err


def test_mtls_metastore_and_client(tmp_path, tlscerts):
    pki = tlscerts.make_pki(tmp_path)
    server_tls = TLSConfig.load(pki.cert, pki.key, pki.ca)
    running = start(MetaStoreConfig(port=0, tls=server_tls))
    try:
        with MetaStoreClient(running.target, tls=server_tls, timeout_s=5) as ok:
            assert ok.stats().capacity_bytes == 0  # an answer: the handshake succeeded both ways
        for tls in (None, TLSConfig.load(ca=pki.ca)):  # plain; TLS without a client certificate
            with MetaStoreClient(running.target, tls=tls, timeout_s=2) as refused:
                with pytest.raises(MetaStoreUnavailable):
                    refused.stats()
    finally:
        running.shutdown(grace_s=0)
