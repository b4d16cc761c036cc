"""Security defaults of the metastore: it binds 127.0.0.1 unless told otherwise, serves plain gRPC
without TLS flags, TLS with --tls-cert/--tls-key and mTLS with --tls-ca (kvcore.tls)."""
import pytest
from kvcore.metaclient import MetaStoreClient, MetaStoreUnavailable
from kvcore.tls import TLSConfig
from kvoffload_metastore.config import MetaStoreConfig
from kvoffload_metastore.server import config_from_args, main, start

# libs/kvcore/tests/support is on the root pytest pythonpath
tlscerts = pytest.importorskip("tlscerts", reason="needs the cryptography package (root test extra)")


@pytest.fixture
def no_conf_env(monkeypatch):
    monkeypatch.delenv("MMC_META_CONFIG_PATH", raising=False)
    monkeypatch.delenv("MMC_LOCAL_CONFIG_PATH", raising=False)


def test_binds_loopback_and_plain_by_default(no_conf_env):
    config, _ = config_from_args([])
    assert config.host == "127.0.0.1" and config.bind_address == "127.0.0.1:5000"
    assert config.tls is None


def test_tls_flags_load(no_conf_env, tmp_path):
    pki = tlscerts.make_pki(tmp_path)
    config, _ = config_from_args(["--tls-cert", str(pki.cert), "--tls-key", str(pki.key), "--tls-ca", str(pki.ca)])
    assert config.tls.mutual and config.tls.cert_path == str(pki.cert)


@pytest.mark.parametrize("argv, message", [
    (["--tls-key", "k.pem"], "--tls-key given without --tls-cert"),
    (["--tls-ca", "CA"], "--tls-ca given without --tls-cert/--tls-key: kvoffload-metastore serves gRPC"),
    (["--tls-cert", "/nonexistent/c.pem", "--tls-key", "/nonexistent/k.pem"],
     "--tls-cert /nonexistent/c.pem: cannot read"),
])
def test_bad_tls_flags_exit_2_naming_the_flag(no_conf_env, capsys, tmp_path, argv, message):
    if argv[-1] == "CA":
        argv = ["--tls-ca", str(tlscerts.make_pki(tmp_path).ca)]
    assert main(argv) == 2
    assert message in capsys.readouterr().err


def test_mtls_metastore_and_client(tmp_path):
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
