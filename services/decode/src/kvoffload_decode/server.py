"""``kvoffload-decode``: the kv_consumer. Parses the node's configs as users write them, loads the
model, builds the sparse-offload decoder over its host pool, serves the Transfer control port
(gRPC, ``kv_port + dp_rank * tp + tp_rank``) and the OpenAI HTTP API, and shuts down in order on
SIGTERM/SIGINT."""

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
from kvcore.settings import decode_settings, check_flags
from kvoffload_proto.v1 import stats_pb2, stats_pb2_grpc, transfer_pb2_grpc

from kvoffload_decode import __version__
from kvoffload_decode.app import AppSettings, build_app
from kvoffload_decode.loop import DecodeLoop
from kvoffload_decode.transfer import TransferServicer

SERVICE = "kvoffload-decode"
log = structlog.get_logger(__name__)


class StatsServicer(stats_pb2_grpc.StatsServicer):
    def __init__(self, loop: DecodeLoop, transfer: TransferServicer) -> None:
        self.loop, self.transfer = loop, transfer

    def GetStats(self, request, context):
        pool = self.loop.decoder.pool.stats()
        counters = {**self.loop.stats(), **self.transfer.counters, "pool_used_bytes": pool.used_bytes,
                    "pool_used_blocks": pool.used_blocks, "pool_live_leases": pool.live_leases}
        return stats_pb2.StatsReply(service=SERVICE, version=__version__,
                                    counters={k: float(v) for k, v in counters.items()},
                                    ledger_json=self.loop.ledger.snapshot() if request.include_ledger else "")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=SERVICE, description=__doc__.splitlines()[0])
    p.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    p.add_argument("--model", required=True, help="model directory (config.json + safetensors)")
    p.add_argument("--served-model-name", help="model id shared with the prefill (default: the directory name)")
    p.add_argument("--host", default="127.0.0.1", help="bind and advertise address (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8200, help="HTTP port")
    p.add_argument("--kv-transfer-config", required=True, help="SfaRemoteD2HConnector kv_consumer JSON")
    p.add_argument("--additional-config", help="JSON with sparse_kv_offload_config")
    p.add_argument("--max-model-len", type=int, default=16384)
    p.add_argument("--max-num-seqs", type=int, default=8)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--dp-rank", type=int, default=0)
    p.add_argument("--dtype", choices=["bfloat16", "float32"], help="default: the config's torch_dtype")
    p.add_argument("--metaserver-timeout-s", type=float, default=600.0)
    p.add_argument("--peer-timeout-s", type=float, default=10.0,
                   help="fail a request whose prefill sent no heartbeat or data for this long (default 10)")
    p.add_argument("--read-retries", type=int, default=2, help="retries of a failed layer read (default 2)")
    p.add_argument("--admission-wait-s", type=float, default=300.0,
                   help="how long a request waits for a free sequence slot and host blocks before 503 (default 300)")
    p.add_argument("--shutdown-grace-s", type=float, default=30.0,
                   help="on SIGTERM, how long in-flight requests get to finish before they are failed (default 30)")
    p.add_argument("--log-level", default="info")
    kvtls.add_tls_arguments(p)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        check_flags(args, at_least_one=("max_model_len", "max_num_seqs", "block_size"),
                    at_least_zero=("dp_rank", "read_retries"), seconds=("metaserver_timeout_s", "peer_timeout_s"),
                    seconds_or_zero=("admission_wait_s", "shutdown_grace_s"), ports=("port",))
    except ConfigError as exc:
        print(f"{SERVICE}: {exc}", file=sys.stderr)
        return 2
    try:  # before anything starts: a bad TLS flag fails fast, naming the flag and the path
        tls = kvtls.from_args(args, serving=SERVICE)
    except kvtls.TLSConfigError as exc:
        print(f"{SERVICE}: {exc}", file=sys.stderr)
        return 2
    kvtls.configure(tls)  # the gRPC clients of this process (the streamed pulls from a prefill) use it
    configure_logging(SERVICE, args.log_level)
    from dsamodel.engine import build
    from dsamodel.engine.decode import SparseDecoder
    from dsamodel.engine.layout import kv_layout
    from dsamodel.tokenizer import ByteTokenizer
    from dsamodel.weights import load_model

    model = load_model(args.model, dtype=args.dtype)
    layout = kv_layout(model.config, args.block_size, model.dtype)
    try:
        settings = decode_settings(args.kv_transfer_config, args.additional_config, layout,
                                   index_topk=model.config.index_topk, max_num_seqs=args.max_num_seqs,
                                   max_model_len=args.max_model_len, dp=args.dp_rank + 1, tp=1)
        require_available(transfer_backend=settings.d2h.transfer_backend)
    except (ConfigError, BackendUnavailableError) as exc:
        print(f"{SERVICE}: {exc}", file=sys.stderr)
        return 2
    for w in settings.warnings:
        log.warning("config_warning", warning=w)
    stale = sweep_stale_segments()  # what killed predecessors left in /dev/shm
    if stale:
        log.warning("stale_segments_removed", paths=stale)
    control_port = settings.control_port(args.dp_rank, 0)
    pool = build.decode_pool(model, args.block_size, settings.host_pool_bytes,
                             name=f"kvoffload-decode-{control_port}-{uuid.uuid4().hex[:6]}")
    decoder = SparseDecoder(model, pool, topk_buffer_size=settings.sparse.topk_buffer_size,
                            max_num_seqs=args.max_num_seqs, max_model_len=args.max_model_len,
                            keep_device_kv_cache=settings.sparse.keep_device_kv_cache)
    loop = DecodeLoop(decoder, model.config.eos_token_id, peer_timeout_s=args.peer_timeout_s)
    model_id = args.served_model_name or Path(args.model).resolve().name
    transfer = TransferServicer(loop, layout, model_id, host_id(), model.dtype, read_retries=args.read_retries,
                                tls=tls)

    server = grpc.server(ThreadPoolExecutor(max_workers=16, thread_name_prefix="transfer"),
                         options=[("grpc.so_reuseport", 0), ("grpc.max_receive_message_length", 8 << 20)])
    health_servicer = health.HealthServicer()
    transfer_pb2_grpc.add_TransferServicer_to_server(transfer, server)
    stats_pb2_grpc.add_StatsServicer_to_server(StatsServicer(loop, transfer), server)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    kvtls.add_port(server, f"{args.host}:{control_port}", tls)
    server.start()
    app = build_app(loop, transfer, ByteTokenizer.from_dir(args.model),
                    AppSettings(model_name=model_id, max_model_len=args.max_model_len, advertise_host=args.host,
                                control_port=control_port, metaserver_timeout_s=args.metaserver_timeout_s,
                                admission_wait_s=args.admission_wait_s))
    health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    log.info("serving", http=f"{args.host}:{args.port}", control_port=control_port, model=model_id,
             topk_buffer_size=settings.sparse.topk_buffer_size, host_pool_bytes=settings.host_pool_bytes,
             keep_device_kv_cache=settings.sparse.keep_device_kv_cache, **(tls.describe() if tls else {"tls": False}))
    try:
        asyncio.run(serve_until_signal(
            app, args.host, args.port, lambda: loop.stats()["pending"] + loop.stats()["running"], args.shutdown_grace_s,
            lambda: health_servicer.set("", health_pb2.HealthCheckResponse.NOT_SERVING)))
    finally:
        health_servicer.enter_graceful_shutdown()
        server.stop(grace=5).wait()
        loop.close()
        transfer.close()
        pool.close()
        log.info("stopped")
    return 0


def cli() -> None:
    """The console script: ``main``, then exit at once (everything was released in order already)."""
    exit_now(main())


if __name__ == "__main__":
    cli()
