"""The metastore process: ``kvoffload-metastore [flags]`` (see ``--help`` and README.md).

``start(config)`` builds and starts everything and returns a ``RunningMetaStore`` (tests use it
in-process); ``serve(config)`` is ``start`` plus the signal-driven shutdown of STYLE 14.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import grpc
import structlog
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from kvcore.config.mmc_files import LOCAL_ENV, META_ENV, parse_size_bytes
from kvoffload_metastore import __version__
from kvoffload_metastore.config import MetaStoreConfig, build_config
from kvoffload_metastore.core import MetaStoreCore
from kvoffload_metastore.metrics import MetaMetrics
from kvoffload_metastore.servicer import MetaStoreServicer, StatsServicer
from kvoffload_proto.v1 import metastore_pb2_grpc, stats_pb2_grpc
from svcruntime import tls as kvtls
from svcruntime.logs import configure_logging

SERVICE = "kvoffload-metastore"
HEALTH_NAMES = ("", "kvoffload.v1.MetaStore", "kvoffload.v1.Stats")
log = structlog.get_logger("kvoffload_metastore.server")


@dataclass
class RunningMetaStore:
    config: MetaStoreConfig
    core: MetaStoreCore
    metrics: MetaMetrics
    server: grpc.Server
    health: health.HealthServicer
    port: int
    metrics_port: int

    @property
    def target(self) -> str:
        host = f"[{self.config.host}]" if ":" in self.config.host else self.config.host
        return f"{host}:{self.port}"

    def shutdown(self, grace_s: float | None = None) -> None:
        """STYLE 14 order: health NOT_SERVING, stop accepting and drain RPCs, then release the state."""
        grace_s = self.config.grace_s if grace_s is None else grace_s
        self.health.enter_graceful_shutdown()
        self.server.stop(grace_s).wait()
        pools, leases = self.core.shutdown()
        self.metrics.stop_http()
        log.info("stopped", released_pools=pools, released_leases=leases)


def start(config: MetaStoreConfig, *, clock: Callable[[], float] = time.monotonic) -> RunningMetaStore:
    core = MetaStoreCore(
        world_size=config.world_size,
        lease_ttl_ms=config.lease_ttl_ms,
        heartbeat_timeout_ms=config.heartbeat_timeout_ms,
        dram_bytes_per_local_service=config.dram_bytes_per_local_service,
        clock=clock,
    )
    metrics = MetaMetrics(core)
    server = grpc.server(
        ThreadPoolExecutor(max_workers=config.max_workers, thread_name_prefix="metastore"),
        options=[("grpc.so_reuseport", 0)],
    )  # a second metastore on the port fails to bind
    health_servicer = health.HealthServicer()
    for name in HEALTH_NAMES:
        health_servicer.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
    info = {
        "bind_address": config.bind_address,
        "conf_files": ",".join(config.sources),
        "log_level": config.log_level,
        "tls": "off" if config.tls is None else "mtls" if config.tls.mutual else "tls",
    }
    metastore_pb2_grpc.add_MetaStoreServicer_to_server(MetaStoreServicer(core, metrics), server)
    stats_pb2_grpc.add_StatsServicer_to_server(StatsServicer(SERVICE, __version__, core, metrics, info), server)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    try:
        port = kvtls.add_port(server, config.bind_address, config.tls)
    except RuntimeError as e:
        raise OSError(f"cannot bind {config.bind_address}: {e}") from None
    server.start()
    metrics_port = metrics.start_http(config.host, config.metrics_port) if config.metrics_port else 0
    for name in HEALTH_NAMES:  # ready: the core is built and the port is bound
        health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    log.info(
        "serving",
        address=config.bind_address.rsplit(":", 1)[0] + f":{port}",
        port=port,
        metrics_port=metrics_port,
        world_size=config.world_size,
        tls=info["tls"],
        lease_ttl_ms=config.lease_ttl_ms,
        heartbeat_timeout_ms=config.heartbeat_timeout_ms,
    )
    return RunningMetaStore(config, core, metrics, server, health_servicer, port, metrics_port)


def serve(config: MetaStoreConfig) -> int:
    """Start, wait for SIGTERM/SIGINT, shut down in order. Returns the exit status."""
    stop = threading.Event()

    def on_signal(signum: int, _frame: object) -> None:
        log.info("signal received", signal=signal.Signals(signum).name)
        stop.set()

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}  # PID 1 has no default
    try:
        running = start(config)
        stop.wait()
        running.shutdown()
    finally:
        for sig, handler in previous.items():  # None: a handler not set from Python (faulthandler's)
            signal.signal(sig, signal.SIG_DFL if handler is None else handler)
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=SERVICE, description="The MetaService of kvoffload's embedded host KV pool.")
    p.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    p.add_argument("--meta-config", help=f"mmc-meta.conf (default: ${META_ENV})")
    p.add_argument("--local-config", help=f"mmc-local.conf (default: ${LOCAL_ENV})")
    p.add_argument("--host", help="bind address (default 127.0.0.1, or ock.mmc.meta_service_url)")
    p.add_argument("--port", type=int, help="gRPC port (default 5000, or ock.mmc.meta_service_url; 0 = any free)")
    p.add_argument("--lease-ttl-ms", type=int, help="default read-lease TTL (default 30000)")
    p.add_argument("--world-size", type=int, help="most LocalService pools at once (default 256)")
    p.add_argument("--dram-size", help="host memory per LocalService, e.g. 10GB (reported in Stats)")
    p.add_argument(
        "--heartbeat-timeout-ms", type=int, help="a pool without heartbeats this long expires (default 10000)"
    )
    p.add_argument("--log-level", help="debug|info|warning|error|critical (default info)")
    p.add_argument("--metrics-port", type=int, help="Prometheus /metrics port on --host (default 0 = off)")
    p.add_argument("--grace-s", type=float, help="seconds in-flight RPCs get at shutdown (default 5)")
    kvtls.add_tls_arguments(p)
    return p


def config_from_args(argv: Sequence[str] | None = None) -> tuple[MetaStoreConfig, list[tuple[str, str]]]:
    a = build_parser().parse_args(argv)
    dram = parse_size_bytes(a.dram_size, "--dram-size") if a.dram_size is not None else None
    if a.log_level is not None:
        a.log_level = a.log_level.lower()
    tls = kvtls.from_args(a, serving=SERVICE)  # TLSConfigError (a ValueError) names the flag and the path
    return build_config(
        meta_config=a.meta_config,
        local_config=a.local_config,
        host=a.host,
        port=a.port,
        lease_ttl_ms=a.lease_ttl_ms,
        world_size=a.world_size,
        dram_bytes_per_local_service=dram,
        heartbeat_timeout_ms=a.heartbeat_timeout_ms,
        log_level=a.log_level,
        metrics_port=a.metrics_port,
        grace_s=a.grace_s,
        tls=tls,
    )


def main(argv: Sequence[str] | None = None) -> int:
    try:
        config, notes = config_from_args(argv)
    except ValueError as e:
        print(f"{SERVICE}: invalid configuration: {e}", file=sys.stderr)
        return 2
    configure_logging(SERVICE, config.log_level)
    for level, note in notes:
        getattr(log, level)("config key not used", note=note)
    try:
        return serve(config)
    except OSError as e:
        log.error("cannot start", error=str(e))
        return 1


def cli() -> None:
    """The console script: ``main``, then exit at once. Everything was released in order already;
    the interpreter's own exit (gRPC's core winding down) took another 1-2.5 s, past a container's
    2 s stop bound. (Not ``svcruntime.serving.exit_now``: it unlinks shared-memory segments, which a
    metastore never creates, and its module brings the HTTP services' serving stack along.)"""
    rc = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(rc)


if __name__ == "__main__":
    cli()
