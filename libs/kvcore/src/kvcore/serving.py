"""The process lifecycle the prefill and decode share around their HTTP API (no service logic).

- ``refuse_while_draining(service)``: an aiohttp middleware; once ``app[DRAINING]`` is set, new
  requests get 503 (a balancer retries elsewhere) and ``/health`` says so, while requests already
  running are not touched.
- ``serve_until_signal``: serve until SIGTERM/SIGINT, then drain: set ``DRAINING``, call
  ``on_drain`` (e.g. gRPC health NOT_SERVING), give the ``busy()`` in-flight requests up to
  ``grace_s`` to finish (a second signal cuts it short), then close the HTTP side; whatever still
  runs is failed and freed by the ordered shutdown that follows.
- ``exit_now(rc)``: the console script's end once that shutdown released everything: the
  interpreter's own teardown (torch, thread pools) would add a second to every stop.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import time
from collections.abc import Callable

import structlog
from aiohttp import web

from kvcore.segment import unlink_owned_segments

DRAINING = web.AppKey("draining", asyncio.Event)  # set on SIGTERM: no new requests, in-flight ones finish

log = structlog.get_logger(__name__)


def refuse_while_draining(service: str):
    """The middleware of ``service``'s app (the app must hold ``app[DRAINING] = asyncio.Event()``)."""

    @web.middleware
    async def middleware(request: web.Request, handler):
        if request.app[DRAINING].is_set() and (request.method == "POST" or request.path == "/health"):
            return web.json_response({"error": {"message": f"{service} is shutting down; retry on another {service}",
                                                "type": "unavailable", "code": 503}}, status=503)
        return await handler(request)

    return middleware


async def serve_until_signal(app: web.Application, host: str, port: int, busy: Callable[[], int], grace_s: float,
                             on_drain: Callable[[], None]) -> None:
    runner = web.AppRunner(app, handle_signals=False)
    await runner.setup()
    await web.TCPSite(runner, host, port).start()
    signals: asyncio.Queue = asyncio.Queue()
    aio = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):  # installed explicitly: PID 1 in a container has none
        aio.add_signal_handler(sig, signals.put_nowait, sig)
    await signals.get()
    app[DRAINING].set()
    on_drain()
    log.info("draining", in_flight=busy(), grace_s=grace_s)
    deadline = time.monotonic() + grace_s
    while busy() and time.monotonic() < deadline and signals.empty():
        await asyncio.sleep(0.05)
    log.info("shutting_down", unfinished=busy())
    await runner.cleanup()


def exit_now(rc: int) -> None:
    unlink_owned_segments()  # what the exit hooks would do, and os._exit skips
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(rc)
