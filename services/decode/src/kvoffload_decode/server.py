"""``kvoffload-decode``: the kv_consumer. Parses the node's configs as users write them, loads the
model, builds the sparse-offload decoder over its host pool, serves the Transfer control port
(gRPC, ``kv_port + dp_rank * tp + tp_rank``) and the OpenAI HTTP API, and shuts down in order on
SIGTERM/SIGINT. With transfer_backend "memfabric" it pulls every layer through memfabric_hybrid
(``pdlink.memfabric``); where that cannot start, it stops with memfabric's reason (exit 2)."""

from __future__ import annotations

import argparse
import os
import sys
import uuid
from pathlib import Path

import structlog
from kvcore.backends import require_available
from kvcore.config import ConfigError
from kvcore.segment import host_id
from kvcore.settings import DecodeSettings, decode_settings
from kvoffload_proto.v1 import transfer_pb2_grpc
from pdlink.memfabric import MemfabricNotInstalled, MemfabricRows, MemfabricTransfer, MemfabricUnavailable
from svcruntime import tls as kvtls
from svcruntime.serving import GrpcSide, StartupError, StatsSnapshot, exit_now, run, serve_http, start_process

from kvoffload_decode import __version__
from kvoffload_decode.app import AppSettings, build_app
from kvoffload_decode.loop import DEFAULT_STEP_GATHER_S, DecodeLoop
from kvoffload_decode.transfer import TransferServicer

SERVICE = "kvoffload-decode"
FLAG_RULES = dict(at_least_one=("max_model_len", "max_num_seqs", "block_size"),
                  at_least_zero=("dp_rank", "read_retries", "max_queued_requests"),
                  seconds=("metaserver_timeout_s", "peer_timeout_s"),
                  seconds_or_zero=("shutdown_grace_s", "step_gather_ms"),
                  ports=("port",))
log = structlog.get_logger(__name__)


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
    p.add_argument("--tensor-parallel-size", type=int, default=1,
                   help="TP ranks: this process is rank 0 and starts ranks 1..N-1 on this host, each with its own "
                        "control port (kv_port + dp_rank*N + rank), pool and shard of the model (default 1)")
    p.add_argument("--dtype", choices=["bfloat16", "float32"], help="default: the config's torch_dtype")
    p.add_argument("--metaserver-timeout-s", type=float, default=600.0)
    p.add_argument("--peer-timeout-s", type=float, default=10.0,
                   help="fail a request whose prefill sent no heartbeat or data for this long (default 10)")
    p.add_argument("--read-retries", type=int, default=2, help="retries of a failed layer read (default 2)")
    p.add_argument("--max-queued-requests", type=int, default=0,
                   help="requests admitted but not yet in the running batch; one more gets 429 with Retry-After "
                        "at once (default 0: as many as the host pool holds at max_model_len/4 tokens each, "
                        "at least 4 x --max-num-seqs, at most 1024)")
    p.add_argument("--step-gather-ms", type=float, default=DEFAULT_STEP_GATHER_S * 1000,
                   help="at saturation (more admitted requests still being prefilled or pulled than the batch has "
                        "room for), hold the next step up to this long after the previous one began, so they join "
                        f"it (default {DEFAULT_STEP_GATHER_S * 1000:g}; 0: step at once; below saturation it never waits)")
    p.add_argument("--speculative-config", metavar="JSON",
                   help='MTP speculative decoding, vLLM\'s format: {"method": "deepseek_mtp", '
                        '"num_speculative_tokens": 1} (greedy requests; the model needs an MTP layer)')
    p.add_argument("--shutdown-grace-s", type=float, default=30.0,
                   help="on SIGTERM, how long in-flight requests get to finish before they are failed (default 30)")
    p.add_argument("--log-level", default="info")
    kvtls.add_tls_arguments(p)
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser().parse_args(argv)
    return run(SERVICE, lambda: serve(args, argv))


def serve(args: argparse.Namespace, argv: list[str]) -> int:
    from dsamodel.engine import build
    from dsamodel.engine.decode import SparseDecoder
    from dsamodel.engine.layout import kv_layout
    from dsamodel.engine.speculative import parse_speculative_config
    from dsamodel.tokenizer import ByteTokenizer
    from dsamodel.weights import load_model

    tls = start_process(SERVICE, args, log_level=args.log_level, **FLAG_RULES)
    try:
        speculative = parse_speculative_config(args.speculative_config)
    except ValueError as exc:
        raise ConfigError([str(exc)]) from None
    model = load_model(args.model, dtype=args.dtype)
    if speculative and not model.config.num_nextn_predict_layers:
        raise ConfigError([f"--speculative-config: the model at {args.model} has no MTP layer "
                           "(num_nextn_predict_layers is 0)"])
    layout = kv_layout(model.config, args.block_size, model.dtype)
    settings = settings_of(args, layout, model.config.index_topk)
    if settings.tp > 1 and settings.d2h.transfer_backend == "memfabric":
        raise ConfigError([f"--tensor-parallel-size: got {settings.tp}; with transfer_backend 'memfabric' the decode "
                           "runs one rank, use 1"])
    memfabric = _memfabric_rows(args, settings.d2h, layout)
    tp_rank = 0  # this process; ranks 1..tp-1 are its TPRanks
    control_port = settings.control_port(args.dp_rank, tp_rank)
    ranks = _tp_ranks(args, model, settings.tp, argv)
    try:
        pool = build.decode_pool(model, args.block_size, settings.host_pool_bytes,
                                 name=f"kvoffload-decode-{control_port}-{uuid.uuid4().hex[:6]}")
    except BaseException:
        if ranks is not None:
            ranks.close()
        raise
    if ranks is None:
        decoder = SparseDecoder(model, pool, **decoder_options(args, settings))
    else:
        decoder = ranks.lead(model, pool, **decoder_options(args, settings))
    loop = DecodeLoop(decoder, model.config.eos_token_id, peer_timeout_s=args.peer_timeout_s,
                      max_queued=args.max_queued_requests or None, num_speculative_tokens=speculative,
                      step_gather_s=args.step_gather_ms / 1000)
    model_id = model_id_of(args)
    transfer = TransferServicer(loop, layout, model_id, host_id(), model.dtype, read_retries=args.read_retries,
                                tls=tls, memfabric=memfabric, tp_rank=tp_rank, tp_size=settings.tp)
    grpc_side = GrpcSide(SERVICE, __version__, lambda ledger: _stats(loop, transfer, ledger), workers=16,
                         options=[("grpc.max_receive_message_length", 8 << 20)],
                         not_ready=ranks.not_ready if ranks else (lambda: ""))
    grpc_side.add(transfer_pb2_grpc.add_TransferServicer_to_server, transfer)
    grpc_side.add_port(f"{args.host}:{control_port}", tls)
    app = build_app(loop, transfer, ByteTokenizer.from_dir(args.model),
                    AppSettings(model_name=model_id, max_model_len=args.max_model_len, advertise_host=args.host,
                                control_port=control_port, dp_rank=args.dp_rank, tp_size=settings.tp,
                                metaserver_timeout_s=args.metaserver_timeout_s),
                    not_ready=ranks.not_ready if ranks else (lambda: ""))
    grpc_side.start()
    log.info("serving", http=f"{args.host}:{args.port}", control_port=control_port, model=model_id,
             topk_buffer_size=settings.sparse.topk_buffer_size, hot_cache_policy=settings.sparse.hot_cache_policy,
             miss_prefetch=settings.sparse.miss_prefetch, host_pool_bytes=settings.host_pool_bytes,
             keep_device_kv_cache=settings.sparse.keep_device_kv_cache, max_queued_requests=loop.max_queued,
             step_gather_ms=args.step_gather_ms, tensor_parallel_size=settings.tp,
             num_speculative_tokens=speculative, transfer_backend=settings.d2h.transfer_backend,
             **({"memfabric_session": memfabric.transfer.session} if memfabric else {}),
             **(tls.describe() if tls else {"tls": False}))
    serve_http(app, args.host, args.port, busy=lambda: loop.stats()["pending"] + loop.stats()["running"],
               grace_s=args.shutdown_grace_s, grpc_side=grpc_side,
               closers=(loop.close, transfer.close, *((ranks.close,) if ranks else ()), pool.close))
    return 0


def _tp_ranks(args: argparse.Namespace, model, size: int, argv: list[str]):
    """Ranks 1..size-1 started and joined, ``model`` sharded (None with one rank); a size the model
    cannot be sharded over is a ConfigError naming both."""
    from dsamodel.tp import check_tp_size

    from kvoffload_decode.tp_ranks import TPRanks

    if size == 1:
        return None
    try:
        check_tp_size(model.config, size)
    except ValueError as exc:
        raise ConfigError([f"--tensor-parallel-size: {exc}"]) from None
    import torch

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // size))  # the ranks share this host's cores
    return TPRanks.start(model, size=size, argv=argv)


def model_id_of(args: argparse.Namespace) -> str:
    return args.served_model_name or Path(args.model).resolve().name


def decoder_options(args: argparse.Namespace, settings: DecodeSettings) -> dict:
    """The ``SparseDecoder`` keywords these flags and configs give (every TP rank builds the same)."""
    return dict(topk_buffer_size=settings.sparse.topk_buffer_size, max_num_seqs=args.max_num_seqs,
                max_model_len=args.max_model_len, keep_device_kv_cache=settings.sparse.keep_device_kv_cache,
                hot_cache_policy=settings.sparse.hot_cache_policy, miss_prefetch=settings.sparse.miss_prefetch)


def settings_of(args: argparse.Namespace, layout, index_topk: int | None) -> DecodeSettings:
    """The node's configs as users write them, for this decode; ConfigError names what is wrong."""
    if args.tensor_parallel_size < 1:
        raise ConfigError([f"--tensor-parallel-size: got {args.tensor_parallel_size}; must be an int >= 1"])
    settings = decode_settings(args.kv_transfer_config, args.additional_config, layout, index_topk=index_topk,
                               max_num_seqs=args.max_num_seqs, max_model_len=args.max_model_len,
                               dp=args.dp_rank + 1, tp=args.tensor_parallel_size)
    vllm_only = settings.d2h.vllm_only_problems()
    if vllm_only:
        raise ConfigError(vllm_only)
    require_available(transfer_backend=settings.d2h.transfer_backend)
    for w in settings.warnings:
        log.warning("config_warning", warning=w)
    return settings


def _memfabric_rows(args: argparse.Namespace, d2h, layout) -> MemfabricRows | None:
    """transfer_backend "memfabric": this decode's memfabric TransferEngine (role "Decode", at --host)
    and its registered staging buffer (--max-model-len rows of the widest layer); else None. Where
    memfabric cannot start (no Ascend driver, no wheel) a StartupError with its own reason: never the
    embedded data path."""
    if d2h.transfer_backend != "memfabric":
        return None
    widest = max(s.main.row_bytes + (s.indexer.row_bytes if s.indexer else 0) for s in layout.layers)
    try:
        transfer = MemfabricTransfer.start("Decode", args.host, device_id=d2h.memfabric_device_id,
                                           data_op=d2h.memfabric_data_op)
        try:
            return MemfabricRows(transfer, args.max_model_len * widest)
        except BaseException:
            transfer.close()
            raise
    except (MemfabricUnavailable, MemfabricNotInstalled, ValueError) as e:
        raise StartupError(f"transfer_backend 'memfabric': {e}") from None


def _stats(loop: DecodeLoop, transfer: TransferServicer, include_ledger: bool) -> StatsSnapshot:
    pool = loop.decoder.pool.stats()
    counters = {**loop.stats(), **transfer.counters, "pool_used_bytes": pool.used_bytes,
                "pool_used_blocks": pool.used_blocks, "pool_live_leases": pool.live_leases}
    return StatsSnapshot(counters, ledger_json=loop.ledger.snapshot() if include_ledger else "")


def cli() -> None:
    """The console script: ``main``, then exit at once (everything was released in order already)."""
    exit_now(main())


if __name__ == "__main__":
    cli()
