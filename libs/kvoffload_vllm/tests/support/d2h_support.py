"""What the remote D2H connector's worker-side tests share: a metaserver stand-in answering the
decode's registration, free ports, the settings of one side, and waits on a consumer's news."""

from __future__ import annotations

import http.server
import json
import socket
import threading
import time

from kvoffload_vllm.d2h_consumer import Consumer
from kvoffload_vllm.d2h_settings import D2HSettings


class Metaserver:
    """Answers every registration 200 and keeps the bodies."""

    def __init__(self) -> None:
        self.bodies: list[dict] = []
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self):
                outer.bodies.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
                self.send_response(200)
                self.end_headers()
                self.wfile.write(b'{"status": "ok"}')

            def log_message(self, *args):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1/metaserver"

    def close(self) -> None:
        self.server.shutdown()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def settings(role: str, backend: str, control_port: int | None = None, **kw) -> D2HSettings:
    return D2HSettings(role, control_port, "127.0.0.1", 0, 1.0, 10.0, transfer_backend=backend, **kw)


def until(check, timeout_s: float = 10.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        got = check()
        if got:
            return got
        time.sleep(0.02)
    raise AssertionError("timed out")


def ended(consumer: Consumer) -> tuple[set[str], set[str]]:
    return until(lambda: (lambda r: r if r[0] or r[1] else None)(consumer.finished()))
