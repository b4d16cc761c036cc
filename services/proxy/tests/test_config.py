"""Flags -> ProxyConfig, and the exact error each invalid flag gets."""

import subprocess
import sys

import pytest

from kvoffload_proxy.config import is_wildcard, parse_args

BASE = [
    "--prefiller-hosts",
    "127.0.0.1",
    "--prefiller-ports",
    "8100",
    "--decoder-hosts",
    "127.0.0.1",
    "--decoder-ports",
    "8200",
]


def test_guide_command_line():
    cfg = parse_args(["--host", "127.0.0.1", "--port", "9000", *BASE])
    assert [b.url for b in cfg.prefillers] == ["http://127.0.0.1:8100"]
    assert [b.url for b in cfg.decoders] == ["http://127.0.0.1:8200"]
    assert cfg.advertised_metaserver_url == "http://127.0.0.1:9000/v1/metaserver"
    assert cfg.host == "127.0.0.1" and cfg.api_key is None
    assert cfg.prefill_kv_weight == 0.3


def test_defaults_to_loopback():
    assert parse_args(BASE).host == "127.0.0.1"


def test_several_backends_and_overrides():
    cfg = parse_args(
        [
            "--prefiller-hosts",
            "10.0.0.1",
            "10.0.0.2",
            "--prefiller-ports",
            "8100",
            "8101",
            "--decoder-hosts",
            "::1",
            "node-3",
            "--decoder-ports",
            "8200",
            "8200",
            "--metaserver-url",
            "http://10.0.0.9:9000/v1/metaserver",
            "--api-key",
            "k",
            "--max-retries",
            "0",
            "--request-timeout-s",
            "2.5",
        ]
    )
    assert [b.url for b in cfg.prefillers] == ["http://10.0.0.1:8100", "http://10.0.0.2:8101"]
    assert [b.url for b in cfg.decoders] == ["http://[::1]:8200", "http://node-3:8200"]
    assert [b.index for b in cfg.decoders] == [0, 1]
    assert cfg.advertised_metaserver_url == "http://10.0.0.9:9000/v1/metaserver"
    assert (cfg.api_key, cfg.max_retries, cfg.request_timeout_s) == ("k", 0, 2.5)


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "", "[::]", "0:0:0:0:0:0:0:0", "0"])
def test_wildcard_host_refused_with_reason(host):
    assert is_wildcard(host)
    with pytest.raises(
        ValueError,
        match=r"^--host .* wildcard address: decoders call the "
        r"proxy's /v1/metaserver",
    ):
        parse_args(["--host", host, *BASE])


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--prefiller-hosts", "a", "b"], r"^--prefiller-ports: 1 port\(s\) for 2 --prefiller-hosts"),
        (["--decoder-ports", "1", "2"], r"^--decoder-ports: 2 port\(s\) for 1 --decoder-hosts"),
        (["--decoder-ports", "70000"], r"^--decoder-ports: 70000 is not a TCP port"),
        (["--port", "0"], r"^--port 0: Input should be greater than or equal to 1"),
        (["--decoder-hosts", "0.0.0.0"], r"^--decoder-hosts '0.0.0.0' is a wildcard"),
        (["--prefiller-hosts", "bad host!"], r"^--prefiller-hosts 'bad host!' is neither"),
        (["--prefiller-hosts", "h", "h", "--prefiller-ports", "1", "1"], r"listed more than once"),
        (["--metaserver-url", "ftp://x/y"], r"^--metaserver-url 'ftp://x/y': .*http\(s\) URL"),
        (["--metaserver-url", "http://0.0.0.0:9000/v1/metaserver"], r"wildcard host"),
        (["--request-timeout-s", "0"], r"^--request-timeout-s 0.0: Input should be greater than 0"),
        (["--metaserver-timeout-s", "-1"], r"^--metaserver-timeout-s"),
        (["--max-retries", "-1"], r"^--max-retries -1"),
        (["--max-request-bytes", "10"], r"^--max-request-bytes 10"),
        (["--prefill-kv-weight", "-0.5"], r"^--prefill-kv-weight"),
    ],
)
def test_invalid_flags_name_the_flag(extra, message):
    with pytest.raises(ValueError, match=message):
        parse_args([*BASE, *extra])


def test_api_key_errors_do_not_echo_the_key():
    with pytest.raises(ValueError) as e:
        parse_args([*BASE, "--api-key", "sec ret"])
    assert str(e.value).startswith("--api-key:") and "sec ret" not in str(e.value)


def test_cli_exits_2_with_the_reason():
    r = subprocess.run(
        [sys.executable, "-m", "kvoffload_proxy", "--host", "0.0.0.0", *BASE],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert r.returncode == 2
    assert "wildcard address" in r.stderr and "/v1/metaserver" in r.stderr
