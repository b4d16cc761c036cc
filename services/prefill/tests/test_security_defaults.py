"""Security defaults of the prefill: HTTP and the gRPC data port (LayerSource, Health, Stats) bind
127.0.0.1 unless told otherwise; gRPC is plain without TLS flags; a bad TLS flag fails before the
model loads, naming the flag.

The bind and plain gRPC are checked on the running process, in
tests/integration/test_binds_default.py (its listening sockets, read from /proc); here: the
TLS flags."""

import pytest

from kvoffload_prefill.server import main

REQUIRED = ["--model", "/nonexistent-model", "--kv-transfer-config", "{}"]


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--tls-key", "k.pem"], "--tls-key given without --tls-cert"),
        (
            ["--tls-cert", "/nonexistent/c.pem", "--tls-key", "/nonexistent/k.pem"],
            "--tls-cert /nonexistent/c.pem: cannot read",
        ),
    ],
)
def test_bad_tls_flags_exit_2_before_the_model_loads(capsys, argv, message):
    assert main([*REQUIRED, *argv]) == 2
    assert message in capsys.readouterr().err
