"""Security defaults of the prefill: HTTP and the gRPC data port (LayerSource, Health, Stats) bind
127.0.0.1 unless told otherwise; gRPC is plain without TLS flags; a bad TLS flag fails before the
model loads, naming the flag."""
import pytest

from kvoffload_prefill.server import build_parser, main

REQUIRED = ["--model", "/nonexistent-model", "--kv-transfer-config", "{}"]


def test_binds_loopback_and_plain_by_default():
    args = build_parser().parse_args(REQUIRED)
    assert args.host == "127.0.0.1"  # the HTTP port and the gRPC data port both bind --host
    assert (args.tls_cert, args.tls_key, args.tls_ca) == (None, None, None)


@pytest.mark.parametrize("argv, message", [
    (["--tls-key", "k.pem"], "--tls-key given without --tls-cert"),
    (["--tls-cert", "/nonexistent/c.pem", "--tls-key", "/nonexistent/k.pem"],
     "--tls-cert /nonexistent/c.pem: cannot read"),
])
def test_bad_tls_flags_exit_2_before_the_model_loads(capsys, argv, message):
    assert main([*REQUIRED, *argv]) == 2
    assert message in capsys.readouterr().err
