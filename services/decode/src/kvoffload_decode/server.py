"""``kvoffload-decode``: the kv_consumer. Parses the node's configs as users write them, loads the
model, builds the sparse-offload decoder over its host pool, serves the Transfer control port
(gRPC, ``kv_port + dp_rank * tp + tp_rank``) and the OpenAI HTTP API, and shuts down in order on
SIGTERM/SIGINT. With a transfer_backend that has an engine (``kvcore.transferregistry``: "memfabric",
"mooncake") it pulls every layer through it (``pdlink.engines``); where that cannot start, it stops
with the engine's reason (exit 2). With ``--tensor-parallel-size N`` it is rank 0 of N and starts
the others (``kvoffload_decode.tp_ranks``); its flags and settings are ``kvoffload_decode.options``."""

from __future__ import annotations

import argparse
import sys
import uuid
from collections.abc import Callable

import structlog
from aiohttp import web

from kvcore.config.errors import ConfigError
from kvcore.pool.segment import host_id
from kvcore.transferregistry import uses_engine
from kvoffload_decode import __version__
from kvoffload_decode.app import AppSettings, build_app
from kvoffload_decode.loop import DecodeLoop
from kvoffload_decode.options import FLAG_RULES, SERVICE, DecodeConfig, build_parser, config_of
from kvoffload_decode.transfer import decode_transfer
from kvoffload_proto.v1 import transfer_pb2_grpc
from pdlink.engine_rows import EngineRows
from pdlink.engines import EngineUnavailable, start_engine
from pdlink.transfer_service import TransferServicer
from svcruntime.ranks import share_cores
from svcruntime.serving import GrpcSide, StartupError, StatsSnapshot, exit_now, run, serve_http, start_process
from svcruntime.tls import TLSConfig

log = structlog.get_logger(__name__)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser().parse_args(argv)
    return run(SERVICE, lambda: serve(args, argv))


def serve(args: argparse.Namespace, argv: list[str]) -> int:
    from kvoffload_engine.model_layout import kv_layout

    tls = start_process(SERVICE, args, log_level=args.log_level, **FLAG_RULES)
    model, speculative = _load_model(args)
    layout = kv_layout(model.config, args.block_size, model.dtype)
    cfg = config_of(args, layout, model.config.index_topk)
    settings = cfg.settings
    engine = _engine_rows(cfg, layout)
    tp_rank = 0  # this process; ranks 1..tp-1 are its TPRanks
    control_port = settings.control_port(cfg.dp_rank, tp_rank)
    pool = _decode_pool(cfg, model, control_port)
    try:
        ranks = _tp_ranks(model, settings.tp, argv, pool.segment.name)
    except BaseException:
        pool.close()
        raise
    not_ready = ranks.not_ready if ranks else (lambda: "")
    decoder = _decoder(cfg, model, ranks, pool)
    loop = DecodeLoop(
        decoder,
        model.config.eos_token_id,
        peer_timeout_s=cfg.peer_timeout_s,
        max_queued=cfg.max_queued_requests,
        num_speculative_tokens=speculative,
        step_gather_s=cfg.step_gather_s,
        max_queue_wait_s=cfg.max_queue_wait_s,
    )
    transfer = decode_transfer(
        loop,
        layout,
        cfg.model_id,
        host_id(),
        read_retries=cfg.read_retries,
        tls=tls,
        engine=engine,
        tp_rank=tp_rank,
        tp_size=settings.tp,
    )
    grpc_side = _control_side(loop, transfer, f"{cfg.host}:{control_port}", tls, not_ready)
    app = _http_app(cfg, loop, transfer, cfg.model_id, settings.tp, control_port, not_ready)
    grpc_side.start()
    _log_serving(cfg, loop, control_port, speculative, engine, tls)
    serve_http(
        app,
        cfg.host,
        cfg.port,
        busy=lambda: int(loop.stats()["pending"] + loop.stats()["running"]),
        grace_s=cfg.shutdown_grace_s,
        grpc_side=grpc_side,
        closers=(loop.close, transfer.close, *((ranks.close,) if ranks else ()), pool.close),
    )
    return 0


def _control_side(
    loop: DecodeLoop, transfer: TransferServicer, address: str, tls: TLSConfig | None, not_ready: Callable[[], str]
) -> GrpcSide:
    """The gRPC side: the Transfer control port (at ``address``), Stats and health."""
    grpc_side = GrpcSide(
        SERVICE,
        __version__,
        lambda ledger: _stats(loop, transfer, ledger),
        workers=16,
        options=[("grpc.max_receive_message_length", 8 << 20)],
        not_ready=not_ready,
    )
    grpc_side.add(transfer_pb2_grpc.add_TransferServicer_to_server, transfer)
    grpc_side.add_port(address, tls)
    return grpc_side


def _http_app(
    cfg: DecodeConfig,
    loop: DecodeLoop,
    transfer: TransferServicer,
    model_id: str,
    tp_size: int,
    control_port: int,
    not_ready: Callable[[], str],
) -> web.Application:
    """The OpenAI HTTP API over ``loop`` (``kvoffload_decode.app``)."""
    from dsamodel.auto_tokenizer import load_tokenizer

    return build_app(
        loop,
        transfer,
        load_tokenizer(cfg.model),
        AppSettings(
            model_name=model_id,
            max_model_len=cfg.max_model_len,
            advertise_host=cfg.host,
            control_port=control_port,
            dp_rank=cfg.dp_rank,
            tp_size=tp_size,
            metaserver_timeout_s=cfg.metaserver_timeout_s,
        ),
        not_ready=not_ready,
    )


def _log_serving(
    cfg: DecodeConfig,
    loop: DecodeLoop,
    control_port: int,
    speculative: int,
    engine: EngineRows | None,
    tls: TLSConfig | None,
) -> None:
    """The ``serving`` line: where this decode listens and how it is set up."""
    settings = cfg.settings
    log.info(
        "serving",
        http=f"{cfg.host}:{cfg.port}",
        control_port=control_port,
        model=cfg.model_id,
        topk_buffer_size=settings.sparse.topk_buffer_size,
        hot_cache_policy=settings.sparse.hot_cache_policy,
        miss_prefetch=settings.sparse.miss_prefetch,
        host_pool_bytes=settings.host_pool_bytes,
        keep_device_kv_cache=settings.sparse.keep_device_kv_cache,
        max_queued_requests=loop.max_queued,
        step_gather_ms=round(cfg.step_gather_s * 1000, 3),
        max_queue_wait_s=cfg.max_queue_wait_s,
        tensor_parallel_size=settings.tp,
        num_speculative_tokens=speculative,
        transfer_backend=settings.d2h.transfer_backend,
        **({"engine_session": engine.transfer.session} if engine else {}),
        **(tls.describe() if tls else {"tls": False}),
    )


def _load_model(args: argparse.Namespace):
    """The model, and the speculative tokens of ``--speculative-config`` (0: off); a config the model
    cannot run (no MTP layer) is a ConfigError."""
    from dsamodel.served import sparse_ready
    from dsamodel.weights import load_model
    from kvoffload_engine.speculative import parse_speculative_config

    try:
        speculative = parse_speculative_config(args.speculative_config)
    except ValueError as exc:
        raise ConfigError([str(exc)]) from None
    model = load_model(args.model, dtype=args.dtype)
    why = sparse_ready(model, args.model)
    if why:  # a Llama model whose indexer was never built
        raise ConfigError([f"--model: {why}"])
    if speculative and not model.config.num_nextn_predict_layers:
        raise ConfigError(
            [f"--speculative-config: the model at {args.model} has no MTP layer (num_nextn_predict_layers is 0)"]
        )
    return model, speculative


def _decode_pool(cfg: DecodeConfig, model, control_port: int):
    """This DP rank's host pool (``dram_size_per_dp_GB``), created by rank 0; its TP followers attach
    it (``kvcore.pool.attached``)."""
    from kvoffload_engine import build

    name = f"kvoffload-decode-{control_port}-{uuid.uuid4().hex[:6]}"
    return build.decode_pool(model, cfg.block_size, cfg.settings.host_pool_bytes, name=name)


def _decoder(cfg: DecodeConfig, model, ranks, pool):
    """The decoder over ``pool``: a ``SparseDecoder``, or with TP ranks, rank 0's ``LeadDecoder``."""
    from kvoffload_engine.decode import SparseDecoder

    if ranks is None:
        return SparseDecoder(model, pool, **cfg.decoder_options())
    return ranks.lead(model, pool, **cfg.decoder_options())


def _tp_ranks(model, size: int, argv: list[str], pool_segment: str):
    """Ranks 1..size-1 started (each attaching rank 0's pool, ``pool_segment``) and joined, ``model``
    sharded (None with one rank); a size the model cannot be sharded over is a ConfigError naming both."""
    from dsamodel.tp import check_tp_size
    from kvoffload_decode.tp_ranks import TPRanks

    if size == 1:
        return None
    try:
        check_tp_size(model.config, size)
    except ValueError as exc:
        raise ConfigError([f"--tensor-parallel-size: {exc}"]) from None
    share_cores(size)  # the ranks share this host's cores
    return TPRanks.start(model, size=size, argv=argv, pool_segment=pool_segment)


def _engine_rows(cfg: DecodeConfig, layout) -> EngineRows | None:
    """A transfer_backend with an engine (``uses_engine``): this decode's transfer engine at --host
    (``pdlink.engines``) and its registered staging buffer (--max-model-len rows of the widest
    layer); else None. Where it cannot start (no Ascend driver, no wheel) a StartupError with its own
    reason: never the embedded data path."""
    d2h = cfg.settings.d2h
    backend = d2h.transfer_backend
    if backend is None or not uses_engine(backend):
        return None
    widest = max(s.main.row_bytes + (s.indexer.row_bytes if s.indexer else 0) for s in layout.layers)
    try:
        transfer = start_engine(backend, "Decode", cfg.host, d2h)
    except EngineUnavailable as e:
        raise StartupError(str(e)) from None
    try:
        return EngineRows(transfer, cfg.max_model_len * widest)
    except (ValueError, RuntimeError) as e:  # the staging buffer refused by the engine
        transfer.close()
        raise StartupError(f"transfer_backend {d2h.transfer_backend!r}: {e}") from None


def _stats(loop: DecodeLoop, transfer: TransferServicer, include_ledger: bool) -> StatsSnapshot:
    pool, device = loop.decoder.pool.stats(), loop.decoder.allocator.stats()
    counters = {
        **loop.stats(),
        **transfer.counters,
        # the device KV this rank holds for all its sequence slots: the indexer keys of every row and
        # the hot top-k buffers (decode.*: kvoffload_engine.decode), or the full KV with keep_device_kv_cache
        "device_kv_bytes": device.current_bytes,
        "device_indexer_bytes": device.current_by_tag.get("decode.indexer", 0),
        "device_hot_bytes": device.current_by_tag.get("decode.hot", 0),
        "max_num_seqs": loop.decoder.max_num_seqs,
        "pool_used_bytes": pool.used_bytes,
        "pool_used_blocks": pool.used_blocks,
        "pool_live_leases": pool.live_leases,
    }
    return StatsSnapshot(counters, ledger_json=loop.ledger.snapshot() if include_ledger else "")


def cli() -> None:
    """The console script: ``main``, then exit at once (everything was released in order already)."""
    exit_now(main())


if __name__ == "__main__":
    cli()
