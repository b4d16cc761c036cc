"""The process lifecycle every kvoffload service shares (no service logic).

A service's ``main`` reads top-down with these parts:

- ``run(service, body)``: runs the service body; a start-up error (``StartupError``, a config,
  TLS or backend error) is printed as ``<service>: <reason>`` and the exit status is 2.
- ``start_process(service, args, **flag_rules)``: numeric flags checked, TLS loaded from the flags
  and configured for every gRPC client of the process, logging set up; returns the TLS config.
- ``GrpcSide``: the service's gRPC server with ``grpc.health.v1`` (readiness asked of a callable
  on every check, never a hard-coded SERVING) and ``kvoffload.v1.Stats`` (a snapshot callable).
- ``draining_app``: a model service's aiohttp app, answering 503 once it drains; ``error_response``:
  an HTTP error in the OpenAI API's shape.
- ``serve_http``: serve an aiohttp app until SIGTERM/SIGINT, then drain — set ``DRAINING``
  (``refuse_while_draining``: new requests and ``/health`` get 503), health NOT_SERVING, give
  in-flight requests ``grace_s`` (a second signal cuts it short), close HTTP — and shut down in
  order: gRPC health, gRPC server (grace), then each closer, in the order given.
- ``exit_now(rc)``: the console script's end once everything was released in order: the
  interpreter's own teardown (torch, thread pools) would add a second to every stop.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import grpc
import structlog
from aiohttp import web
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from kvcore.backends import BackendUnavailableError
from kvcore.config.errors import ConfigError
from kvcore.pool.segment import sweep_stale_segments, unlink_owned_segments
from kvoffload_proto.v1 import stats_pb2, stats_pb2_grpc
from svcruntime import tls as kvtls
from svcruntime.flags import check_flags
from svcruntime.logs import configure_logging

DRAINING = web.AppKey("draining", asyncio.Event)  # set on SIGTERM: no new requests, in-flight ones finish
SERVING, NOT_SERVING = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING

log = structlog.get_logger(__name__)


class StartupError(Exception):
    """A reason the service cannot start, for the operator (printed as ``<service>: <reason>``)."""


STARTUP_ERRORS = (StartupError, ConfigError, kvtls.TLSConfigError, BackendUnavailableError)


def run(service: str, body: Callable[[], int]) -> int:
    """``body()``'s exit status, or 2 after printing a start-up error."""
    try:
        return body()
    except STARTUP_ERRORS as exc:
        print(f"{service}: {exc}", file=sys.stderr)
        return 2


def start_process(service: str, args: Any, *, log_level: str = "info", **flag_rules: tuple[str, ...]):
    """Before anything starts: ``check_flags(args, **flag_rules)``, TLS from ``--tls-*`` (configured
    for the process's gRPC clients), logging, and the shared-memory segments killed predecessors
    left in /dev/shm removed. Returns the ``TLSConfig`` (None: plain gRPC)."""
    check_flags(args, **flag_rules)
    tls = kvtls.from_args(args, serving=service)
    kvtls.configure(tls)
    try:
        configure_logging(service, log_level)
    except ValueError as exc:
        raise StartupError(f"--log-level: {exc}") from None
    stale = sweep_stale_segments()
    if stale:
        log.warning("stale_segments_removed", paths=stale)
    return tls


# ---- gRPC: health + Stats ------------------------------------------------------------------------


@dataclass(frozen=True)
class StatsSnapshot:
    """What ``kvoffload.v1.Stats`` answers: counters (numbers), info (strings), the ledger as JSON."""

    counters: dict[str, float]
    info: dict[str, str] = field(default_factory=dict)
    ledger_json: str = ""


class StatsServicer(stats_pb2_grpc.StatsServicer):
    """``kvoffload.v1.Stats`` from a ``snapshot(include_ledger)`` callable."""

    def __init__(self, service: str, version: str, snapshot: Callable[[bool], StatsSnapshot]) -> None:
        self._service, self._version, self._snapshot = service, version, snapshot
        self._started = time.monotonic()

    def GetStats(self, request, context):
        s = self._snapshot(request.include_ledger)
        return stats_pb2.StatsReply(
            service=self._service,
            version=self._version,
            counters={k: float(v) for k, v in s.counters.items()},
            info=s.info,
            ledger_json=s.ledger_json if request.include_ledger else "",
            uptime_ms=int((time.monotonic() - self._started) * 1000),
        )


class ReadinessHealth(health.HealthServicer):
    """``grpc.health.v1`` whose status is asked of ``not_ready()`` (a reason, "" when ready) at every
    check, until ``drain()``; NOT_SERVING before ``start`` and after ``drain``."""

    def __init__(self, not_ready: Callable[[], str], names: Sequence[str] = ("",)) -> None:
        super().__init__()
        self._not_ready, self._names = not_ready, tuple(names)
        self._phase = "starting"  # starting | serving | draining
        self._set(NOT_SERVING)

    def _set(self, status) -> None:
        for name in self._names:
            self.set(name, status)

    def _refresh(self) -> None:
        if self._phase == "serving":
            self._set(NOT_SERVING if self._not_ready() else SERVING)

    def start(self) -> None:
        self._phase = "serving"
        self._refresh()

    def drain(self) -> None:
        self._phase = "draining"
        self._set(NOT_SERVING)

    def Check(self, request, context):
        self._refresh()
        return super().Check(request, context)


class GrpcSide:
    """A service's gRPC server: its own servicers (``add``), ``grpc.health.v1`` and ``kvoffload.v1.Stats``."""

    def __init__(
        self,
        service: str,
        version: str,
        stats: Callable[[bool], StatsSnapshot],
        *,
        workers: int,
        not_ready: Callable[[], str] = lambda: "",
        health_names: Sequence[str] = ("",),
        options: Sequence[tuple[str, Any]] = (),
    ) -> None:
        self.server = grpc.server(
            ThreadPoolExecutor(max_workers=workers, thread_name_prefix=service),
            options=[("grpc.so_reuseport", 0), *options],
        )  # a second bind fails
        self.health = ReadinessHealth(not_ready, health_names)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        stats_pb2_grpc.add_StatsServicer_to_server(StatsServicer(service, version, stats), self.server)

    def add(self, register: Callable[[Any, grpc.Server], None], servicer: Any) -> None:
        """``register(servicer, server)``: a generated ``add_*Servicer_to_server``."""
        register(servicer, self.server)

    def add_port(self, address: str, tls: Any = kvtls.PROCESS) -> int:
        return kvtls.add_port(self.server, address, tls)

    def start(self) -> None:
        """Start serving RPCs and report readiness from now on."""
        self.server.start()
        self.health.start()

    def stop(self, grace_s: float) -> None:
        """STYLE 14 order: health NOT_SERVING, then stop accepting and let RPCs in flight finish."""
        self.health.drain()
        self.health.enter_graceful_shutdown()
        self.server.stop(grace=grace_s).wait()


# ---- HTTP: drain on SIGTERM, then the ordered shutdown --------------------------------------------


def error_response(status: int, message: str, code: str) -> web.Response:
    """An HTTP error as the OpenAI API answers it: ``{"error": {"message", "type": code, "code": status}}``."""
    return web.json_response({"error": {"message": message, "type": code, "code": status}}, status=status)


def too_busy_response(message: str, retry_after_s: float) -> web.Response:
    """The 429 of a request a service's queue refused: ``message``, OpenAI's ``rate_limit_error``,
    ``Retry-After`` (whole seconds)."""
    resp = error_response(429, message, "rate_limit_error")
    resp.headers["Retry-After"] = str(int(retry_after_s))
    return resp


def draining_app(service: str) -> web.Application:
    """An aiohttp app of ``service`` (bodies up to 32 MiB) that refuses new requests once it drains
    (``refuse_while_draining``)."""
    app = web.Application(client_max_size=32 << 20, middlewares=[refuse_while_draining(service)])
    app[DRAINING] = asyncio.Event()
    return app


def refuse_while_draining(service: str):
    """The middleware of ``service``'s app (the app must hold ``app[DRAINING] = asyncio.Event()``)."""

    @web.middleware
    async def middleware(request: web.Request, handler):
        if request.app[DRAINING].is_set() and (request.method == "POST" or request.path == "/health"):
            return error_response(503, f"{service} is shutting down; retry on another {service}", "unavailable")
        return await handler(request)

    return middleware


async def serve_until_signal(
    app: web.Application, host: str, port: int, busy: Callable[[], int], grace_s: float, on_drain: Callable[[], None]
) -> None:
    """Serve ``app`` until SIGTERM/SIGINT, then drain (see the module docstring) and close HTTP."""
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


def serve_http(
    app: web.Application,
    host: str,
    port: int,
    *,
    busy: Callable[[], int],
    grace_s: float,
    grpc_side: GrpcSide,
    closers: Sequence[Callable[[], None]],
) -> None:
    """Serve until a signal and drain (``serve_until_signal``), then stop gRPC and call ``closers`` in order."""
    try:
        asyncio.run(serve_until_signal(app, host, port, busy, grace_s, grpc_side.health.drain))
    finally:
        grpc_side.stop(grace_s=5)
        for close in closers:
            close()
        log.info("stopped")


def exit_now(rc: int) -> None:
    unlink_owned_segments()  # what the exit hooks would do, and os._exit skips
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(rc)
