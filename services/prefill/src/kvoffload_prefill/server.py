"""``kvoffload-prefill``: the kv_producer. Takes ``--kv-transfer-config`` as users write it
(AscendStoreConnector alone, or MultiConnector with SfaRemoteD2HConnector + AscendStoreConnector),
refuses sparse offload, runs layerwise prefill over shared-memory layer buffers and the host pool,
serves LayerSource + Health + Stats over gRPC and the OpenAI HTTP dispatch, and shuts down in order
on SIGTERM/SIGINT."""

from __future__ import annotations

import argparse
import asyncio
import sys
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import structlog
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from kvcore import tls as kvtls
from kvcore.backends import BackendUnavailableError, require_available
from kvcore.config import ConfigError
from kvcore.logs import configure_logging
from kvcore.segment import host_id, sweep_stale_segments
from kvcore.serving import exit_now, serve_until_signal
from kvcore.settings import prefill_settings, check_flags
from kvoffload_proto.v1 import stats_pb2, stats_pb2_grpc, transfer_pb2_grpc

from kvoffload_prefill import __version__
from kvoffload_prefill.app import build_app
from kvoffload_prefill.source import LayerSourceServicer
from kvoffload_prefill.worker import PrefillWorker

SERVICE = "kvoffload-prefill"
log = structlog.get_logger(__name__)


class StatsServicer(stats_pb2_grpc.StatsServicer):
    def __init__(self, worker: PrefillWorker) -> None:
        self.worker = worker

    def GetStats(self, request, context):
        eng = self.worker.engine
        counters = {**eng.gates.stats(), **self.worker.ledger.counters(),
                    "device_kv_bytes": eng.allocator.stats().current_bytes}
        try:
            pool = eng.pool.stats()
        except Exception as exc:  # e.g. the metastore is down or forgot the pool: Stats still answers
            counters["pool_available"] = 0
            info_pool = repr(exc)
        else:
            counters.update({"pool_available": 1, "pool_used_bytes": pool.used_bytes,
                             "pool_used_blocks": pool.used_blocks, "pool_live_leases": pool.live_leases,
                             "pool_complete_objects": pool.complete_objects})
            info_pool = ""
        return stats_pb2.StatsReply(service=SERVICE, version=__version__,
                                    counters={k: float(v) for k, v in counters.items()},
                                    info={"plan": eng.plan.log_line(), "pool_error": info_pool},
                                    ledger_json=self.worker.ledger.snapshot() if request.include_ledger else "")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=SERVICE, description=__doc__.splitlines()[0])
    p.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    p.add_argument("--model", required=True, help="model directory (config.json + safetensors)")
    p.add_argument("--served-model-name", help="model id shared with the decode (default: the directory name)")
    p.add_argument("--host", default="127.0.0.1", help="bind and advertise address (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8100, help="HTTP port")
    p.add_argument("--data-port", type=int, default=0, help="gRPC LayerSource/Health/Stats port (0: any free)")
    p.add_argument("--kv-transfer-config", required=True, help="AscendStoreConnector or MultiConnector JSON")
    p.add_argument("--additional-config", help="must not enable sparse_kv_offload_config")
    p.add_argument("--max-model-len", type=int, default=16384)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--chunk-size", type=int, default=2048)
    p.add_argument("--host-pool-gb", type=float, default=1.0, help="host KV pool (prefix cache) this node contributes")
    p.add_argument("--metastore", metavar="HOST:PORT",
                   help="kvoffload-metastore that indexes the pool (backend 'kvoffload'); without it the index "
                        "is kept in this process")
    p.add_argument("--read-timeout-s", type=float, default=60.0, help="longest wait for a decode's READ_DONE")
    p.add_argument("--peer-timeout-s", type=float, default=10.0,
                   help="a decode that answers no heartbeat for this long is gone: its reads fail (default 10)")
    p.add_argument("--dtype", choices=["bfloat16", "float32"], help="default: the config's torch_dtype")
    p.add_argument("--shutdown-grace-s", type=float, default=30.0,
                   help="on SIGTERM, how long in-flight requests get to finish before they are failed (default 30)")
    p.add_argument("--log-level", default="info")
    kvtls.add_tls_arguments(p)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        check_flags(args, at_least_one=("max_model_len", "block_size", "chunk_size"),
                    seconds=("host_pool_gb", "read_timeout_s", "peer_timeout_s"),
                    seconds_or_zero=("shutdown_grace_s",), ports=("port",), any_ports=("data_port",))
    except ConfigError as exc:
        print(f"{SERVICE}: {exc}", file=sys.stderr)
        return 2
    try:  # before anything starts: a bad TLS flag fails fast, naming the flag and the path
        tls = kvtls.from_args(args, serving=SERVICE)
    except kvtls.TLSConfigError as exc:
        print(f"{SERVICE}: {exc}", file=sys.stderr)
        return 2
    kvtls.configure(tls)  # the gRPC clients of this process (the metastore, the decode links) use it
    configure_logging(SERVICE, args.log_level)
    from dsamodel.engine import build
    from dsamodel.engine.layout import kv_layout
    from dsamodel.tokenizer import ByteTokenizer
    from dsamodel.weights import load_model

    model = load_model(args.model, dtype=args.dtype)
    layout = kv_layout(model.config, args.block_size, model.dtype)
    try:
        settings = prefill_settings(args.kv_transfer_config, args.additional_config, layout, tp=1)
        if settings.d2h is None:
            raise ConfigError(["kv_transfer_config: a P/D prefill needs SfaRemoteD2HConnector (inside a "
                               "MultiConnector) so the decode can pull its layers"])
        require_available(backend=settings.store.backend, transfer_backend=settings.d2h.transfer_backend)
    except (ConfigError, BackendUnavailableError) as exc:
        print(f"{SERVICE}: {exc}", file=sys.stderr)
        return 2
    for w in settings.warnings:
        log.warning("config_warning", warning=w)
    stale = sweep_stale_segments()  # what killed predecessors left in /dev/shm
    if stale:
        log.warning("stale_segments_removed", paths=stale)
    tag = uuid.uuid4().hex[:8]
    pool_bytes, pool_name = int(args.host_pool_gb * 2**30), f"kvoffload-prefill-pool-{tag}"
    if args.metastore:
        pool = build.remote_prefill_pool(model, args.block_size, pool_bytes, metastore=args.metastore,
                                         pool_id=f"prefill-{args.host}:{args.port}", name=pool_name)
    else:
        pool = build.prefill_pool(model, args.block_size, pool_bytes, name=pool_name)
    model_id = args.served_model_name or Path(args.model).resolve().name
    engine = build.prefill_engine(
        model, pool, buffers=settings.num_shared_buffers if settings.store.use_layerwise else None,
        independent=sorted(settings.independent_layers), chunk_size=args.chunk_size,
        max_model_len=args.max_model_len, prefetch=settings.prefetch_layers, model_id=model_id,
        buffer_segment=f"kvoffload-prefill-buffers-{tag}", gate_timeout_s=args.read_timeout_s + 30,
    )
    engine.plan.log()
    server = grpc.server(ThreadPoolExecutor(max_workers=8, thread_name_prefix="prefill-grpc"),
                         options=[("grpc.so_reuseport", 0)])
    data_port = kvtls.add_port(server, f"{args.host}:{args.data_port}", tls)
    worker = PrefillWorker(engine, model_id=model_id, host_id=host_id(), data_endpoint=f"{args.host}:{data_port}",
                           read_timeout_s=args.read_timeout_s, peer_timeout_s=args.peer_timeout_s)
    health_servicer = health.HealthServicer()
    transfer_pb2_grpc.add_LayerSourceServicer_to_server(LayerSourceServicer(engine, worker.layout_version), server)
    stats_pb2_grpc.add_StatsServicer_to_server(StatsServicer(worker), server)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    server.start()
    app = build_app(worker, ByteTokenizer.from_dir(args.model), model_id, args.max_model_len)
    health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    log.info("serving", http=f"{args.host}:{args.port}", data_port=data_port, model=model_id,
             plan=engine.plan.log_line(), backend=settings.store.backend,
             transfer_backend=settings.d2h.transfer_backend, **(tls.describe() if tls else {"tls": False}))
    try:
        asyncio.run(serve_until_signal(
            app, args.host, args.port, lambda: worker.ledger.counters()["ledger_open"], args.shutdown_grace_s,
            lambda: health_servicer.set("", health_pb2.HealthCheckResponse.NOT_SERVING)))
    finally:
        health_servicer.enter_graceful_shutdown()
        server.stop(grace=5).wait()
        worker.close()
        engine.close()
        pool.close()
        log.info("stopped")
    return 0


def cli() -> None:
    """The console script: ``main``, then exit at once (everything was released in order already)."""
    exit_now(main())


if __name__ == "__main__":
    cli()
