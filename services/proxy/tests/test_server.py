"""serve(): graceful shutdown, and the real console process (SIGTERM, JSON logs)."""

import asyncio
import json
import signal
import socket
import subprocess
import sys
import time

import aiohttp

from kvoffload_proxy.config import parse_args
from kvoffload_proxy.server import serve


def _free_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _cfg(port, prefiller, decoder, *extra):
    return parse_args(
        [
            "--port",
            str(port),
            "--prefiller-hosts",
            "127.0.0.1",
            "--prefiller-ports",
            str(prefiller.port),
            "--decoder-hosts",
            "127.0.0.1",
            "--decoder-ports",
            str(decoder.port),
            *extra,
        ]
    )


async def _events(resp):
    out = []
    async for line in resp.content:
        line = line.decode().strip()
        if line.startswith("data: "):
            out.append(line[6:] if line[6:] == "[DONE]" else json.loads(line[6:]))
    return out


async def test_graceful_shutdown_finishes_in_flight_and_refuses_new(stack):
    await _run_shutdown(stack, grace_s=10, expect_complete=True)


async def _run_shutdown(stack, grace_s, expect_complete):
    async with stack(decoders=("slow",)) as s:  # the fakes; this test serves its own proxy
        port = _free_port()
        cfg = _cfg(port, s.prefillers[0], s.decoders[0], "--shutdown-grace-s", str(grace_s))
        stop = asyncio.Event()
        server = asyncio.create_task(serve(cfg, stop))
        url = f"http://127.0.0.1:{port}"
        async with aiohttp.ClientSession() as http:
            for _ in range(100):
                try:
                    async with http.get(url + "/openapi.json") as r:
                        if r.status == 200:
                            break
                except aiohttp.ClientError:
                    await asyncio.sleep(0.02)
            async with http.post(url + "/v1/completions", json={"prompt": "hi", "stream": True}) as r:
                assert r.status == 200
                assert (await r.content.readline()).startswith(b"data: ")
                stop.set()  # what SIGTERM does
                await asyncio.sleep(0.05)
                async with http.post(url + "/v1/completions", json={"prompt": "x"}) as r2:
                    assert r2.status == 503
                    assert "shutting down" in (await r2.json())["error"]["message"]
                async with http.get(url + "/healthcheck") as r3:
                    assert r3.status == 503
                rest = await _events(r)
        t0 = time.monotonic()
        await asyncio.wait_for(server, 10)
        assert time.monotonic() - t0 < 5
        if expect_complete:
            assert rest[-1] == "[DONE]" and all("error" not in e for e in rest[:-1])
        else:  # past the grace period: told why, then [DONE]
            assert "error" in rest[-2] and rest[-2]["error"]["code"] == 503
            assert rest[-1] == "[DONE]"


async def test_shutdown_deadline_fails_remaining_streams_with_sse_error(stack):
    await _run_shutdown(stack, grace_s=0.2, expect_complete=False)


def test_console_process_sigterm_and_json_logs():
    port = _free_port()
    dead = str(_free_port())
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "kvoffload_proxy",
            "--port",
            str(port),
            "--prefiller-hosts",
            "127.0.0.1",
            "--prefiller-ports",
            dead,
            "--decoder-hosts",
            "127.0.0.1",
            "--decoder-ports",
            dead,
            "--max-retries",
            "0",
        ],
        stderr=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        text=True,
    )
    try:
        import urllib.error
        import urllib.request

        deadline = time.monotonic() + 15
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/openapi.json", timeout=1)
                break
            except (urllib.error.URLError, ConnectionError):
                assert time.monotonic() < deadline and proc.poll() is None
                time.sleep(0.05)
        req = urllib.request.Request(
            f"http://127.0.0.1:{port}/v1/completions",
            data=b'{"prompt": "hi"}',
            method="POST",
            headers={"X-Request-Id": "trace-me"},
        )
        try:
            urllib.request.urlopen(req, timeout=5)
        except urllib.error.HTTPError as e:
            assert e.code == 503 and e.headers["X-Request-Id"] == "trace-me"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=10) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    lines = [json.loads(line) for line in proc.stderr.read().splitlines() if line.strip()]
    events = [line["event"] for line in lines]
    assert events[0] == "proxy_started" and events[-1] == "proxy_stopped"
    traced = [line for line in lines if line["event"] in ("request_start", "request_failed")]
    assert len(traced) == 2 and all(line["request_id"] == "trace-me" for line in traced)
