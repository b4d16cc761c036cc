"""``kvoffload-prefill``: the kv_producer. Takes ``--kv-transfer-config`` as users write it:
MultiConnector with SfaRemoteD2HConnector + AscendStoreConnector (a P/D prefill), or
AscendStoreConnector alone (offload-only: it serves complete requests itself, no decode or proxy);
refuses sparse offload, runs layerwise prefill over shared-memory layer buffers and the host pool
(backend ``kvoffload``: in this process or indexed by the metastore; ``mooncake``: shared through a
mooncake_master; ``memcache``: shared through a Memcache MetaService), serves LayerSource + Health
+ Stats over gRPC and the OpenAI HTTP dispatch, and shuts down in order on SIGTERM/SIGINT. With
a transfer_backend that has an engine (``kvcore.transferregistry``: "memfabric", "mooncake") it registers
its layer buffers with that engine (``pdlink.engines``) and advertises its session in the
layout the decodes get; where that cannot start, it stops with the engine's reason (exit 2)."""

from __future__ import annotations

import argparse
import uuid
from collections.abc import Callable

import structlog

from kvcore.config.errors import ConfigError
from kvcore.config.prefill_settings import PrefillSettings
from kvcore.pool.segment import host_id
from kvcore.transferregistry import uses_engine
from kvoffload_prefill import __version__
from kvoffload_prefill.app import build_app
from kvoffload_prefill.generate import GenerateLoop
from kvoffload_prefill.offload_app import build_offload_app
from kvoffload_prefill.options import FLAG_RULES, SERVICE, PrefillConfig, build_parser, config_of
from kvoffload_prefill.pools import host_pool, pool_counters, pool_not_ready
from kvoffload_prefill.queue_bound import DEFAULT_MAX_QUEUE_WAIT_S, PrefillQueue
from kvoffload_prefill.source import LayerBufferRows
from kvoffload_prefill.worker import PrefillWorker
from kvoffload_proto.v1 import transfer_pb2_grpc
from pdlink.engine_rows import Transfer
from pdlink.engines import EngineUnavailable, register_segment, start_engine
from pdlink.layer_source import LayerSourceServicer
from pdlink.layout_messages import EngineShare
from svcruntime.ranks import share_cores
from svcruntime.serving import GrpcSide, StartupError, StatsSnapshot, exit_now, run, serve_http, start_process

log = structlog.get_logger(__name__)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return run(SERVICE, lambda: serve(args))


def serve(args: argparse.Namespace) -> int:
    from dsamodel.auto_tokenizer import load_tokenizer
    from dsamodel.served import sparse_ready
    from dsamodel.weights import load_model
    from kvoffload_engine import build
    from kvoffload_engine.model_layout import kv_layout

    tls = start_process(SERVICE, args, log_level=args.log_level, **FLAG_RULES)
    model = load_model(args.model, dtype=args.dtype)
    why = sparse_ready(model, args.model)
    if why:  # a Llama model whose indexer was never built: its decode could not select over the rows
        raise ConfigError([f"--model: {why}"])
    cfg = config_of(args, kv_layout(model.config, args.block_size, model.dtype))
    settings = cfg.settings
    backend = settings.d2h.transfer_backend if settings.d2h is not None else None
    if uses_engine(backend) and cfg.tensor_parallel_size > 1:
        raise ConfigError(
            [
                f"--tensor-parallel-size: got {cfg.tensor_parallel_size}; with transfer_backend "
                f"{backend!r} the prefill runs one rank (its followers' layer buffers are not registered "
                "with the transfer engine), use 1"
            ]
        )
    transfer = _engine(cfg.host, settings.d2h)  # before the pool: fail fast, holding nothing
    pf = cfg.pool
    log.info(
        "host pool size",
        bytes=pf.host_pool_bytes,
        source=pf.host_pool_source,
        **({"overrides": list(pf.host_pool_overrides)} if pf.host_pool_overrides else {}),
        **({"index": pf.metastore, "index_source": pf.metastore_source} if pf.metastore else {}),
        **({"mmc_protocol": pf.mmc_protocol} if pf.mmc_protocol else {}),
    )
    tag = uuid.uuid4().hex[:8]
    pool = host_pool(
        cfg, build.prefill_geometry(model, cfg.block_size, pf.host_pool_bytes), f"kvoffload-prefill-pool-{tag}"
    )
    tokenizer = load_tokenizer(cfg.model)
    if settings.d2h is None:
        wrong = []
        if cfg.tensor_parallel_size > 1:
            wrong.append(
                f"--tensor-parallel-size: got {cfg.tensor_parallel_size}; offload-only mode "
                "(no SfaRemoteD2HConnector) runs one rank, use 1"
            )
        if cfg.max_queue_wait_s is not None:
            wrong.append(
                f"--max-queue-wait-s: got {cfg.max_queue_wait_s:g}; it bounds the P/D mode's queue, "
                "offload-only mode (no SfaRemoteD2HConnector) does not take it"
            )
        if wrong:
            pool.close()
            raise ConfigError(wrong)
        return _serve_offload_only(cfg, tls, model, tokenizer, pool)
    return _serve_pd(cfg, tls, model, tokenizer, pool, tag, transfer)


def _serve_pd(cfg: PrefillConfig, tls, model, tokenizer, pool, tag: str, transfer: Transfer | None) -> int:
    """A P/D prefill: layerwise prefill announcing every layer to the decodes a request names, which
    pull it through LayerSource (or a transfer engine); its TP ranks, when ``--tensor-parallel-size`` > 1."""
    settings, model_id = cfg.settings, cfg.model_id
    ranks = _tp_ranks(cfg, model, pool)
    engine = _pd_engine(cfg, model, pool, tag, ranks)
    follower_buffers = _follower_buffers(ranks, engine, tag) if ranks else []
    engine.plan.log()
    not_ready = _readiness(ranks, settings, pool)
    grpc_side = GrpcSide(SERVICE, __version__, lambda ledger: _stats(worker, ledger), workers=8, not_ready=not_ready)
    data_port = grpc_side.add_port(f"{cfg.host}:{cfg.data_port}", tls)
    worker = PrefillWorker(
        engine,
        model_id=model_id,
        host_id=host_id(),
        data_endpoint=f"{cfg.host}:{data_port}",
        read_timeout_s=cfg.read_timeout_s,
        peer_timeout_s=cfg.peer_timeout_s,
        follower_segments=tuple(b.segment.name for b in follower_buffers),
        queue=PrefillQueue(DEFAULT_MAX_QUEUE_WAIT_S if cfg.max_queue_wait_s is None else cfg.max_queue_wait_s),
        engine_share=_share_layer_buffers(transfer, engine) if transfer is not None else None,
    )
    buffers = {lay.layout_version: bufs for lay, bufs in zip(worker.layouts, (engine.buffers, *follower_buffers))}
    grpc_side.add(
        transfer_pb2_grpc.add_LayerSourceServicer_to_server, LayerSourceServicer(LayerBufferRows(engine, buffers))
    )
    app = build_app(worker, tokenizer, model_id, cfg.max_model_len, not_ready=not_ready)
    grpc_side.start()
    _log_serving(cfg, tls, data_port, engine.plan.log_line(), transfer)
    # the transfer engine lets go of the layer buffers before the engine unmaps them
    closers = (
        worker.close,
        *((transfer.close,) if transfer else ()),
        engine.close,
        *(b.close for b in follower_buffers),
        *((ranks.close,) if ranks else ()),
        pool.close,
    )
    serve_http(
        app,
        cfg.host,
        cfg.port,
        busy=lambda: len(worker.ledger.open_ids()),
        grace_s=cfg.shutdown_grace_s,
        grpc_side=grpc_side,
        closers=closers,
    )
    return 0


def _readiness(ranks, settings: PrefillSettings, pool) -> Callable[[], str]:
    """Why a P/D prefill cannot serve now ("" when it can): a TP rank's reason first, then the pool's."""
    if ranks:
        return lambda: ranks.not_ready() or pool_not_ready(settings.store, pool)
    return lambda: pool_not_ready(settings.store, pool)


def _pd_engine(cfg: PrefillConfig, model, pool, tag: str, ranks):
    """A P/D prefill's engine: layerwise prefill into layer buffer segment
    ``kvoffload-prefill-buffers-<tag>``, its TP followers (``ranks``) computing their shards."""
    from kvoffload_engine import build

    settings = cfg.settings
    return build.prefill_engine(
        model,
        pool,
        buffers=settings.num_shared_buffers if settings.store.use_layerwise else None,
        independent=sorted(settings.independent_layers),
        chunk_size=cfg.chunk_size,
        max_model_len=cfg.max_model_len,
        prefetch=settings.prefetch_layers,
        model_id=cfg.model_id,
        buffer_segment=f"kvoffload-prefill-buffers-{tag}",
        gate_timeout_s=cfg.read_timeout_s + 30,
        followers=ranks.followers if ranks else None,
    )


def _log_serving(cfg: PrefillConfig, tls, data_port: int, plan: str, transfer: Transfer | None) -> None:
    """The P/D prefill's ``serving`` line: where it listens, what it runs, how the decodes pull."""
    settings = cfg.settings
    assert settings.d2h is not None  # without a D2H connector serve() runs offload-only
    log.info(
        "serving",
        http=f"{cfg.host}:{cfg.port}",
        data_port=data_port,
        model=cfg.model_id,
        tensor_parallel_size=cfg.tensor_parallel_size,
        plan=plan,
        backend=settings.store.backend,
        transfer_backend=settings.d2h.transfer_backend,
        **({"engine_session": transfer.session} if transfer else {}),
        **(tls.describe() if tls else {"tls": False}),
    )


def _serve_offload_only(cfg: PrefillConfig, tls, model, tokenizer, pool) -> int:
    """Offload-only mode: no decode pulls from this node; it serves complete requests itself
    (``generate.GenerateLoop``: layerwise prefill over the shared buffers and the host pool's
    prefix cache, then decode in this process), with gRPC Health + Stats and the same lifecycle."""
    settings, model_id = cfg.settings, cfg.model_id
    engine = _offload_engine(cfg, model, pool)
    engine.prefill.plan.log()
    loop = GenerateLoop(engine)
    grpc_side = GrpcSide(
        SERVICE,
        __version__,
        lambda ledger: _offload_stats(loop),
        workers=2,
        not_ready=lambda: pool_not_ready(settings.store, pool),
    )
    data_port = grpc_side.add_port(f"{cfg.host}:{cfg.data_port}", tls)
    app = build_offload_app(
        loop, tokenizer, model_id, cfg.max_model_len, not_ready=lambda: pool_not_ready(settings.store, pool)
    )
    grpc_side.start()
    log.info(
        "serving",
        mode="offload-only",
        http=f"{cfg.host}:{cfg.port}",
        data_port=data_port,
        model=model_id,
        plan=engine.prefill.plan.log_line(),
        backend=settings.store.backend,
        max_num_seqs=cfg.max_num_seqs,
        **(tls.describe() if tls else {"tls": False}),
    )
    serve_http(
        app,
        cfg.host,
        cfg.port,
        busy=loop.busy,
        grace_s=cfg.shutdown_grace_s,
        grpc_side=grpc_side,
        closers=(loop.close, engine.close, pool.close),
    )
    return 0


def _offload_engine(cfg: PrefillConfig, model, pool):
    """Offload-only mode's engine: layerwise prefill over ``pool``, and a device KV pool for
    ``--max-num-seqs`` sequences of ``--max-model-len`` tokens to decode them in this process."""
    from kvoffload_engine import build
    from kvoffload_engine.engine import Engine, EngineConfig

    settings = cfg.settings
    blocks_per_seq = -(-cfg.max_model_len // cfg.block_size)
    block_bytes = build.decode_geometry(model, cfg.block_size, 1 << 30).block_bytes
    return Engine(
        model,
        EngineConfig(
            block_size=cfg.block_size,
            max_model_len=cfg.max_model_len,
            max_num_seqs=cfg.max_num_seqs,
            chunk_size=cfg.chunk_size,
            buffers=settings.num_shared_buffers if settings.store.use_layerwise else None,
            independent=tuple(sorted(settings.independent_layers)),
            prefetch_layers=settings.prefetch_layers,
            decode_pool_bytes=block_bytes * blocks_per_seq * cfg.max_num_seqs,
            model_id=cfg.model_id,
        ),
        prefill_pool=pool,
    )


def _offload_stats(loop: GenerateLoop) -> StatsSnapshot:
    eng = loop.engine
    pool, pool_error = pool_counters(eng.prefill_pool)
    counters: dict[str, float] = {**loop.stats(), "device_kv_bytes": eng.allocator.stats().current_bytes, **pool}
    return StatsSnapshot(
        counters, {"mode": "offload-only", "plan": eng.prefill.plan.log_line(), "pool_error": pool_error}, ""
    )


def _stats(worker: PrefillWorker, include_ledger: bool) -> StatsSnapshot:
    eng = worker.engine
    pool, pool_error = pool_counters(eng.pool)
    counters = {
        **eng.gates.stats(),
        **worker.ledger.counters(),
        **worker.queue.stats(),
        "device_kv_bytes": eng.allocator.stats().current_bytes,
        **pool,
    }
    return StatsSnapshot(
        counters,
        {"plan": eng.plan.log_line(), "pool_error": pool_error},
        worker.ledger.snapshot() if include_ledger else "",
    )


def _engine(host: str, d2h) -> Transfer | None:
    """A transfer_backend with an engine (``uses_engine``): this prefill's transfer engine at --host
    (``pdlink.engines``); else (also offload-only: no SfaRemoteD2HConnector) None. Where it cannot
    start (no Ascend driver, no wheel) a StartupError with its own reason: never the embedded data path."""
    if d2h is None or not uses_engine(d2h.transfer_backend):
        return None
    try:
        return start_engine(d2h.transfer_backend, "Prefill", host, d2h)
    except EngineUnavailable as e:
        raise StartupError(str(e)) from None


def _share_layer_buffers(transfer: Transfer, engine) -> EngineShare:
    """Register the layer-buffer segment with the transfer engine: what the layout every decode gets
    says of it (LayoutMetadata.transfer_engine, engine_session, engine_segment_address)."""
    segment = engine.buffers.segment
    address = segment.plane(0).data_ptr() - segment.plane_offsets[0]  # byte 0 of the mapping
    try:
        register_segment(transfer, address, segment.size_bytes)
    except EngineUnavailable as e:
        raise StartupError(str(e)) from None
    return EngineShare(transfer.name, transfer.session, address)


def _tp_ranks(cfg: PrefillConfig, model, pool):
    """Ranks 1..N-1 started and joined, ``model`` sharded (None with one rank); a size the model
    cannot be sharded over is a ConfigError naming both."""
    from dsamodel.tp import check_tp_size
    from kvoffload_prefill.tp_ranks import TPRanks

    size = cfg.tensor_parallel_size
    if size == 1:
        return None
    try:
        check_tp_size(model.config, size)
    except ValueError as exc:
        pool.close()
        raise ConfigError([f"--tensor-parallel-size: {exc}"]) from None
    share_cores(size)  # the ranks share this host's cores
    try:
        return TPRanks.start(model, model_dir=cfg.model, dtype=cfg.dtype, size=size, log_level=cfg.log_level)
    except BaseException:
        pool.close()
        raise


def _follower_buffers(ranks, engine, tag: str) -> list:
    """Each follower creates its layer buffers (``kvoffload_engine.tp_prefill``: contributor
    buffers) and rank 0 attaches them, to name them in that rank's layout and serve them to
    decodes on other hosts. On failure everything started is stopped."""
    from kvcore.device import DeviceAllocator
    from kvoffload_engine.buffers import LayerBuffers

    names = [f"kvoffload-prefill-buffers-{tag}-tp{r}" for r in range(1, ranks.size)]
    try:
        ranks.followers.buffers(engine.plan, engine.buffers.num_blocks, names)
        return [
            LayerBuffers(
                engine.plan,
                engine.buffers.num_blocks,
                DeviceAllocator(engine.model.device),
                engine.model.dtype,
                segment_name=n,
                attach=True,
            )
            for n in names
        ]
    except BaseException:
        engine.close()
        ranks.close()
        engine.pool.close()
        raise


def cli() -> None:
    """The console script: ``main``, then exit at once (everything was released in order already)."""
    exit_now(main())


if __name__ == "__main__":
    cli()
