"""svcruntime.tls: plain gRPC without flags; TLS with --tls-cert/--tls-key; mTLS with --tls-ca on the
server; every misconfiguration is an error that names the flag and the path."""

from __future__ import annotations

import argparse
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
import tlscerts  # test support on the root pytest pythonpath (needs cryptography, a test extra)
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from svcruntime import tls as kvtls
from svcruntime.tls import TLSConfig, TLSConfigError


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    return tlscerts.make_pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture
def serve():
    """``serve(tls)`` -> "127.0.0.1:PORT" of a health server bound with ``kvtls.add_port``."""
    servers = []

    def start(tls: TLSConfig | None) -> str:
        server = grpc.server(ThreadPoolExecutor(max_workers=2))
        servicer = health.HealthServicer()
        servicer.set("", health_pb2.HealthCheckResponse.SERVING)
        health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
        port = kvtls.add_port(server, "127.0.0.1:0", tls)
        assert port > 0
        server.start()
        servers.append(server)
        return f"127.0.0.1:{port}"

    yield start
    for s in servers:
        s.stop(None)


def check(target: str, tls: TLSConfig | None) -> bool:
    """True when a Health.Check through ``secure_or_insecure_channel`` answers SERVING."""
    with kvtls.secure_or_insecure_channel(target, tls) as ch:
        try:
            reply = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5)
        except grpc.RpcError as e:
            assert e.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED), e
            return False
    return reply.status == health_pb2.HealthCheckResponse.SERVING


def test_no_flag_is_plain_grpc(serve):
    assert TLSConfig.load() is None and TLSConfig.load(None, "", None) is None
    assert check(serve(None), None)


def test_tls_server_verified_by_ca(serve, pki):
    target = serve(TLSConfig.load(pki.cert, pki.key))
    assert check(target, TLSConfig.load(ca=pki.ca))  # a client that trusts the CA connects
    assert not check(target, None)  # a plain client does not
    assert not check(target, TLSConfig.load(ca=pki.other_ca))  # nor one that trusts another CA
    assert check(target, TLSConfig.load(pki.cert, pki.key, pki.ca))  # a client cert is optional here


def test_tls_client_cannot_talk_to_a_plain_server(serve, pki):
    assert not check(serve(None), TLSConfig.load(ca=pki.ca))


def test_host_name_is_verified(serve, pki):
    """The peer certificate names 127.0.0.1/::1/localhost; dialled by another name, it is refused."""
    target = serve(TLSConfig.load(pki.cert, pki.key))
    assert check(target.replace("127.0.0.1", "localhost"), TLSConfig.load(ca=pki.ca))
    with grpc.secure_channel(
        target,
        TLSConfig.load(ca=pki.ca).channel_credentials(),
        options=[("grpc.ssl_target_name_override", "not-the-peer.example")],
    ) as ch:
        with pytest.raises(grpc.RpcError) as e:
            health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5)
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE


def test_mtls_requires_a_client_certificate_from_the_ca(serve, pki):
    server_tls = TLSConfig.load(pki.cert, pki.key, pki.ca)
    assert server_tls.mutual
    target = serve(server_tls)
    assert not check(target, TLSConfig.load(ca=pki.ca))  # TLS but no client certificate
    assert not check(target, None)
    assert not check(target, TLSConfig.load(pki.other_cert, pki.other_key, pki.ca))  # certificate of another CA
    assert check(target, TLSConfig.load(pki.client_cert, pki.client_key, pki.ca))  # a client certificate
    assert check(target, server_tls)  # a service's own certificate works as its client certificate


def test_process_default(serve, pki):
    target = serve(TLSConfig.load(pki.cert, pki.key))
    try:
        kvtls.configure(TLSConfig.load(ca=pki.ca))
        assert check(target, kvtls.PROCESS)
        kvtls.configure(None)
        assert not check(target, kvtls.PROCESS)
    finally:
        kvtls.configure(None)
    assert kvtls.current() is None


@pytest.mark.parametrize(
    "given, message",
    [
        ({"key": "KEY"}, r"^--tls-key given without --tls-cert"),
        ({"key": "KEY", "ca": "CA"}, r"^--tls-key given without --tls-cert"),
        ({"cert": "CERT"}, r"^--tls-cert given without --tls-key"),
    ],
)
def test_incomplete_identity_names_the_flags(given, message, pki):
    paths = {"cert": pki.cert, "key": pki.key, "ca": pki.ca}
    with pytest.raises(TLSConfigError, match=message):
        TLSConfig.load(**{k: paths[v.lower()] for k, v in given.items()})


def test_unreadable_file_names_the_flag_and_path(tmp_path, pki):
    missing = tmp_path / "nope.crt"
    with pytest.raises(TLSConfigError, match=rf"^--tls-cert {missing}: cannot read: No such file"):
        TLSConfig.load(missing, pki.key)
    with pytest.raises(TLSConfigError, match=rf"^--tls-ca {missing}: cannot read"):
        TLSConfig.load(ca=missing)
    with pytest.raises(TLSConfigError, match=rf"^--tls-key {tmp_path}: cannot read"):
        TLSConfig.load(pki.cert, tmp_path)  # a directory


def test_not_pem_names_the_flag_and_path(tmp_path, pki):
    junk = tmp_path / "junk.pem"
    junk.write_text("hello\n")
    with pytest.raises(TLSConfigError, match=rf"^--tls-cert {junk}: not a PEM certificate"):
        TLSConfig.load(junk, pki.key)
    with pytest.raises(TLSConfigError, match=rf"^--tls-key {pki.cert}: not a PEM private key"):
        TLSConfig.load(pki.cert, pki.cert)  # a certificate where the key belongs
    with pytest.raises(TLSConfigError, match=rf"^--tls-ca {pki.key}: not a PEM CA certificate bundle"):
        TLSConfig.load(ca=pki.key)


def test_server_needs_its_own_identity(pki):
    ca_only = TLSConfig.load(ca=pki.ca)
    with pytest.raises(TLSConfigError, match=r"^--tls-ca given without --tls-cert/--tls-key: svc serves gRPC"):
        ca_only.require_identity("svc")
    with pytest.raises(TLSConfigError):
        kvtls.add_port(grpc.server(ThreadPoolExecutor(max_workers=1)), "127.0.0.1:0", ca_only)


def test_flags_round_trip_and_no_key_material_in_repr(pki):
    parser = argparse.ArgumentParser()
    kvtls.add_tls_arguments(parser)
    assert kvtls.from_args(parser.parse_args([])) is None
    argv = ["--tls-cert", str(pki.cert), "--tls-key", str(pki.key), "--tls-ca", str(pki.ca)]
    tls = kvtls.from_args(parser.parse_args(argv))
    assert tls.flags() == argv and tls.mutual and tls.has_identity
    assert "PRIVATE" not in repr(tls) and str(pki.key) in repr(tls)
    assert tls.describe() == {"tls": True, "mtls": True, "tls_cert": str(pki.cert), "tls_ca": str(pki.ca)}
    assert TLSConfig.load(ca=pki.ca).flags() == ["--tls-ca", str(pki.ca)]
