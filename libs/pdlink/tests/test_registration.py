"""A decode's registration (``pdlink.registration``): the body the proxy parses, the token only when
given, an HTTP refusal answered at once, an unreachable metaserver retried then named — against a
real HTTP server on loopback."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from openai_api.transfer_params import KVTransferParams
from pdlink.registration import Registration, backoff_s, post


class _Metaserver:
    def __init__(self, status: int) -> None:
        self.status, self.seen = status, []
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                outer.seen.append((dict(self.headers), body))
                payload = b'{"ok": true}' if outer.status == 200 else b"no such request"
                self.send_response(outer.status)
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

            def log_message(self, *args) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1/metaserver"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def metaserver():
    servers: list[_Metaserver] = []

    def start(status: int = 200) -> _Metaserver:
        servers.append(_Metaserver(status))
        return servers[-1]

    yield start
    for s in servers:
        s.close()


def test_the_body_names_the_decodes_endpoint_and_the_proxy_parses_it(metaserver):
    m = metaserver()
    reg = Registration("req-1", m.url, "tok", "10.0.0.2", 7000, tp_size=2, dp_rank=1)
    assert post(reg, timeout_s=5, stop=threading.Event()) == ""
    headers, body = m.seen[0]
    assert body["request_id"] == "req-1" and headers["Authorization"] == "Bearer tok"
    assert headers["X-Request-Id"] == "req-1"
    params = KVTransferParams.model_validate(body["kv_transfer_params"])
    assert (params.remote_host, params.remote_port, params.remote_tp_size, params.remote_dp_rank) == (
        "10.0.0.2",
        7000,
        2,
        1,
    )


def test_no_token_no_authorization_header_and_queued_names_no_endpoint():
    reg = Registration("r", "http://x/v1/metaserver", queued=True)
    assert "Authorization" not in reg.headers()
    params = KVTransferParams.model_validate(reg.body()["kv_transfer_params"])
    assert params.queued and params.remote_host is None and params.remote_port is None


def test_an_http_refusal_is_answered_at_once_with_its_status_and_body(metaserver):
    m = metaserver(404)
    problem = post(Registration("r", m.url, host="h", port=9), timeout_s=5, stop=threading.Event())
    assert problem == f"metaserver {m.url} answered 404: no such request"
    assert len(m.seen) == 1  # an answer is never retried


def test_an_unreachable_metaserver_is_retried_then_named(metaserver):
    m = metaserver()
    url = m.url
    m.close()  # nothing listens there any more
    stop = threading.Event()
    problem = post(Registration("r", url, host="h", port=9), timeout_s=2, stop=stop, retries=2)
    assert problem.startswith(f"metaserver {url} unreachable after 3 attempts"), problem


def test_stop_ends_the_retries_at_once(metaserver):
    m = metaserver()
    url = m.url
    m.close()
    stop = threading.Event()
    stop.set()
    assert "unreachable after 1 attempts" in post(
        Registration("r", url, host="h", port=9), timeout_s=2, stop=stop, retries=5
    )


def test_a_registration_that_names_no_endpoint_is_refused_before_it_is_sent():
    with pytest.raises(ValueError, match="remote_port"):
        Registration("r", "http://x/v1/metaserver", host="h").body()


def test_the_backoff_doubles():
    assert [backoff_s(a) for a in range(3)] == [0.2, 0.4, 0.8]
