"""Security defaults of the decode: HTTP and the gRPC control port (Transfer, Health, Stats) bind
127.0.0.1 unless told otherwise; gRPC is plain without TLS flags; a bad TLS flag fails before the
model loads, naming the flag.

The bind and plain gRPC are checked on the running process, in
tests/integration/test_binds_default.py (its listening sockets, read from /proc); here: the
TLS flags."""

import pytest

from kvoffload_decode.server import main

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


def test_metaserver_token_is_echoed_only_when_it_is_a_plain_token():
    """The proxy's per-request /v1/metaserver token (proxy --api-key) goes back as a bearer header;
    anything that could smuggle header text is dropped, and a token that is not a string refuses
    the request (a 400 naming the field)."""
    from openai_api.body import RequestError
    from openai_api.transfer_params import parse_transfer_params

    def token(value):
        params = parse_transfer_params({"request_id": "r", "metaserver_token": value})
        return params.registration_token

    assert token("ab12" * 16) == "ab12" * 16
    for bad in (None, "", "a b", "a\r\nX-Evil: 1", "x" * 257, "é"):
        assert token(bad) is None
    for bad in (5, ["x"]):
        with pytest.raises(RequestError, match="^kv_transfer_params.metaserver_token"):
            token(bad)
    assert parse_transfer_params({"request_id": "r"}).registration_token is None
