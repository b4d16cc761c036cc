"""`kvoffload-proxy`: build the config at the edge, serve, shut down gracefully.

SIGTERM/SIGINT: stop admitting inference requests (503; /healthcheck turns 503), let in-flight
ones finish for --shutdown-grace-s (the listener stays open meanwhile: their decoders still call
/v1/metaserver), fail the rest (an SSE error event where a stream had started), then close.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys

import structlog
from aiohttp import web

from svcruntime.logs import configure_logging

from .app import FLOW, create_app
from .config import ProxyConfig, build_parser, config_from_namespace

log = structlog.get_logger("kvoffload_proxy.server")


async def serve(cfg: ProxyConfig, stop: asyncio.Event | None = None) -> None:
    stop = stop or asyncio.Event()
    app = create_app(cfg)
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None, shutdown_timeout=5.0)
    await runner.setup()
    try:
        await web.TCPSite(runner, cfg.host, cfg.port).start()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        log.info(
            "proxy_started",
            url=f"http://{cfg.host}:{cfg.port}",
            metaserver=cfg.advertised_metaserver_url,
            prefillers=[b.url for b in cfg.prefillers],
            decoders=[b.url for b in cfg.decoders],
        )
        await stop.wait()
        log.info("proxy_draining", grace_s=cfg.shutdown_grace_s)
        await app[FLOW].drain(cfg.shutdown_grace_s)
        log.info("proxy_closing")
    finally:
        await runner.cleanup()
        log.info("proxy_stopped")


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    try:
        cfg = config_from_namespace(parser.parse_args(argv))
    except ValueError as e:
        parser.error(str(e))
    configure_logging("kvoffload-proxy", cfg.log_level)
    loop = asyncio.new_event_loop()
    try:
        loop.run_until_complete(serve(cfg))
        loop.run_until_complete(loop.shutdown_asyncgens())
    finally:
        loop.close()  # unlike asyncio.run, does not wait for the default executor's threads
    # Everything is closed and logged. A name lookup still running in a resolver thread (aiohttp
    # resolves peers with getaddrinfo in the default executor; it cannot be cancelled, and while the
    # network goes down with its peers it can take the resolver's full timeout) would otherwise hold
    # the interpreter's exit, which joins those threads, past a container's stop timeout.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main())
