"""``kvoffload-prefill``: the kv_producer. Takes ``--kv-transfer-config`` as users write it:
MultiConnector with SfaRemoteD2HConnector + AscendStoreConnector (a P/D prefill), or
AscendStoreConnector alone (offload-only: it serves complete requests itself, no decode or proxy);
refuses sparse offload, runs layerwise prefill over shared-memory layer buffers and the host pool
(backend ``kvoffload``: in this process or indexed by the metastore; ``mooncake``: shared through a
mooncake_master; ``memcache``: shared through a Memcache MetaService), serves LayerSource + Health + Stats over gRPC and the OpenAI HTTP dispatch, and
shuts down in order on SIGTERM/SIGINT. With transfer_backend "memfabric" it registers its layer
buffers with memfabric_hybrid (``pdlink.memfabric``) and advertises its session in the layout the
decodes get; where that cannot start, it stops with memfabric's reason (exit 2)."""

from __future__ import annotations

import argparse
import os
import uuid
from collections.abc import Mapping
from pathlib import Path

import structlog
from kvcore.backends import require_available
from kvcore.config import ConfigError
from kvcore.eviction import LRUEviction
from kvcore.hostpool import LocalHostPool, PoolError
from kvcore.mmcconf import LOCAL_ENV, local_dram_size
from kvcore.segment import host_id
from kvcore.settings import PrefillSettings, prefill_settings
from kvoffload_proto.v1 import transfer_pb2_grpc
from pdlink.memfabric import MemfabricNotInstalled, MemfabricTransfer, MemfabricUnavailable
from poolclient.memcache import MemcacheHostPool
from poolclient.memcache_client import MemcacheUnavailable
from poolclient.memcache_meta import MemcacheNotInstalled
from poolclient.mooncake import MooncakeHostPool
from poolclient.mooncake_master import MooncakeNotInstalled, port_answers
from poolclient.remotepool import RemoteHostPool
from svcruntime import tls as kvtls
from svcruntime.serving import GrpcSide, StartupError, StatsSnapshot, exit_now, run, serve_http, start_process

from kvoffload_prefill import __version__
from kvoffload_prefill.app import build_app
from kvoffload_prefill.generate import GenerateLoop
from kvoffload_prefill.offload_app import build_offload_app
from kvoffload_prefill.source import LayerSourceServicer
from kvoffload_prefill.worker import PrefillWorker

SERVICE = "kvoffload-prefill"
FLAG_RULES = dict(at_least_one=("max_model_len", "block_size", "chunk_size", "max_num_seqs", "tensor_parallel_size"),
                  seconds=("host_pool_gb", "read_timeout_s", "peer_timeout_s"),
                  seconds_or_zero=("shutdown_grace_s",), ports=("port",), any_ports=("data_port",))
MOONCAKE_CONNECT_TIMEOUT_S = 5.0  # the mooncake_master must answer within this at start-up
MOONCAKE_PROBE_TIMEOUT_S = 0.5  # readiness: the master's RPC port accepts a connection within this
log = structlog.get_logger(__name__)


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
    p.add_argument("--host-pool-gb", type=float,
                   help="host KV pool (prefix cache) this node contributes, GiB (default: the store config's "
                        "host_pool_gb, else ock.mmc.local_service.dram.size of --local-config, else 1)")
    p.add_argument("--local-config", help="mmc-local.conf whose ock.mmc.local_service.dram.size sizes the host "
                                          "pool when neither --host-pool-gb nor host_pool_gb is given; with backend "
                                          "memcache also the LocalService's conf, required "
                                          "(default: $MMC_LOCAL_CONFIG_PATH)")
    p.add_argument("--metastore", metavar="HOST:PORT",
                   help="kvoffload-metastore that indexes the pool (default: the store config's metastore); "
                        "without either the index is kept in this process")
    p.add_argument("--read-timeout-s", type=float, default=60.0, help="longest wait for a decode's READ_DONE")
    p.add_argument("--peer-timeout-s", type=float, default=10.0,
                   help="a decode that answers no heartbeat for this long is gone: its reads fail (default 10)")
    p.add_argument("--max-num-seqs", type=int, default=8,
                   help="offload-only mode (no SfaRemoteD2HConnector): requests decoded together (default 8)")
    p.add_argument("--dtype", choices=["bfloat16", "float32"], help="default: the config's torch_dtype")
    p.add_argument("--tensor-parallel-size", type=int, default=1,
                   help="TP ranks (default 1): this process is rank 0 and starts ranks 1..N-1 (gloo); attention "
                        "heads and the MLP are sharded over them; N must divide the model's heads and intermediate")
    p.add_argument("--shutdown-grace-s", type=float, default=30.0,
                   help="on SIGTERM, how long in-flight requests get to finish before they are failed (default 30)")
    p.add_argument("--log-level", default="info")
    kvtls.add_tls_arguments(p)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return run(SERVICE, lambda: serve(args))


def serve(args: argparse.Namespace) -> int:
    from dsamodel.engine import build
    from dsamodel.engine.layout import kv_layout
    from dsamodel.tokenizer import ByteTokenizer
    from dsamodel.weights import load_model

    tls = start_process(SERVICE, args, log_level=args.log_level, **FLAG_RULES)
    model = load_model(args.model, dtype=args.dtype)
    settings = _settings(args, kv_layout(model.config, args.block_size, model.dtype))
    _pool_flags(args, settings.store)
    if settings.d2h is not None and settings.d2h.transfer_backend == "memfabric" and args.tensor_parallel_size > 1:
        raise ConfigError([f"--tensor-parallel-size: got {args.tensor_parallel_size}; with transfer_backend "
                           "'memfabric' the prefill runs one rank (its followers' layer buffers are not registered "
                           "with memfabric), use 1"])
    memfabric = _memfabric(args, settings.d2h)  # before the pool: fail fast, holding nothing
    log.info("host pool size", bytes=args.host_pool_bytes, source=args.host_pool_source,
             **({"overrides": args.host_pool_overrides} if args.host_pool_overrides else {}))
    model_id = args.served_model_name or Path(args.model).resolve().name
    tag = uuid.uuid4().hex[:8]
    pool = _host_pool(args, settings.store, build.prefill_geometry(model, args.block_size, args.host_pool_bytes),
                      f"kvoffload-prefill-pool-{tag}")
    tokenizer = ByteTokenizer.from_dir(args.model)
    if settings.d2h is None:
        if args.tensor_parallel_size > 1:
            pool.close()
            raise ConfigError([f"--tensor-parallel-size: got {args.tensor_parallel_size}; offload-only mode "
                               "(no SfaRemoteD2HConnector) runs one rank, use 1"])
        return _serve_offload_only(args, tls, model, tokenizer, settings, pool, model_id)
    ranks = _tp_ranks(args, model, pool)
    engine = build.prefill_engine(
        model, pool, buffers=settings.num_shared_buffers if settings.store.use_layerwise else None,
        independent=sorted(settings.independent_layers), chunk_size=args.chunk_size,
        max_model_len=args.max_model_len, prefetch=settings.prefetch_layers, model_id=model_id,
        buffer_segment=f"kvoffload-prefill-buffers-{tag}", gate_timeout_s=args.read_timeout_s + 30,
        followers=ranks.followers if ranks else None)
    follower_buffers = _follower_buffers(ranks, engine, tag) if ranks else []
    engine.plan.log()
    not_ready = (lambda: ranks.not_ready() or _not_ready(pool)) if ranks else (lambda: _not_ready(pool))
    grpc_side = GrpcSide(SERVICE, __version__, lambda ledger: _stats(worker, ledger), workers=8,
                         not_ready=not_ready)
    data_port = grpc_side.add_port(f"{args.host}:{args.data_port}", tls)
    worker = PrefillWorker(engine, model_id=model_id, host_id=host_id(), data_endpoint=f"{args.host}:{data_port}",
                           read_timeout_s=args.read_timeout_s, peer_timeout_s=args.peer_timeout_s,
                           follower_segments=tuple(b.segment.name for b in follower_buffers))
    if memfabric is not None:
        _share_layer_buffers(memfabric, engine, worker)
    grpc_side.add(transfer_pb2_grpc.add_LayerSourceServicer_to_server,
                  LayerSourceServicer(engine, {lay.layout_version: bufs for lay, bufs
                                               in zip(worker.layouts, (engine.buffers, *follower_buffers))}))
    app = build_app(worker, tokenizer, model_id, args.max_model_len, not_ready=not_ready)
    grpc_side.start()
    log.info("serving", http=f"{args.host}:{args.port}", data_port=data_port, model=model_id,
             tensor_parallel_size=args.tensor_parallel_size,
             plan=engine.plan.log_line(), backend=settings.store.backend,
             transfer_backend=settings.d2h.transfer_backend,
             **({"memfabric_session": memfabric.session} if memfabric else {}),
             **(tls.describe() if tls else {"tls": False}))
    # memfabric lets go of the layer buffers before the engine unmaps them
    closers = (worker.close, *((memfabric.close,) if memfabric else ()), engine.close,
               *(b.close for b in follower_buffers),
               *((ranks.close,) if ranks else ()), pool.close)
    serve_http(app, args.host, args.port, busy=lambda: worker.ledger.counters()["ledger_open"],
               grace_s=args.shutdown_grace_s, grpc_side=grpc_side, closers=closers)
    return 0


def _serve_offload_only(args: argparse.Namespace, tls, model, tokenizer, settings: PrefillSettings, pool,
                        model_id: str) -> int:
    """Offload-only mode: no decode pulls from this node; it serves complete requests itself
    (``generate.GenerateLoop``: layerwise prefill over the shared buffers and the host pool's
    prefix cache, then decode in this process), with gRPC Health + Stats and the same lifecycle."""
    from dsamodel.engine import build
    from dsamodel.engine.engine import Engine, EngineConfig

    blocks_per_seq = -(-args.max_model_len // args.block_size)
    block_bytes = build.decode_geometry(model, args.block_size, 1 << 30).block_bytes
    engine = Engine(model, EngineConfig(
        block_size=args.block_size, max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
        chunk_size=args.chunk_size, buffers=settings.num_shared_buffers if settings.store.use_layerwise else None,
        independent=tuple(sorted(settings.independent_layers)), prefetch_layers=settings.prefetch_layers,
        decode_pool_bytes=block_bytes * blocks_per_seq * args.max_num_seqs, model_id=model_id), prefill_pool=pool)
    engine.prefill.plan.log()
    loop = GenerateLoop(engine)
    grpc_side = GrpcSide(SERVICE, __version__, lambda ledger: _offload_stats(loop), workers=2,
                         not_ready=lambda: _not_ready(pool))
    data_port = grpc_side.add_port(f"{args.host}:{args.data_port}", tls)
    app = build_offload_app(loop, tokenizer, model_id, args.max_model_len, not_ready=lambda: _not_ready(pool))
    grpc_side.start()
    log.info("serving", mode="offload-only", http=f"{args.host}:{args.port}", data_port=data_port, model=model_id,
             plan=engine.prefill.plan.log_line(), backend=settings.store.backend, max_num_seqs=args.max_num_seqs,
             **(tls.describe() if tls else {"tls": False}))
    serve_http(app, args.host, args.port, busy=loop.busy, grace_s=args.shutdown_grace_s, grpc_side=grpc_side,
               closers=(loop.close, engine.close, pool.close))
    return 0


def _offload_stats(loop: GenerateLoop) -> StatsSnapshot:
    eng = loop.engine
    counters = {**loop.stats(), "device_kv_bytes": eng.allocator.stats().current_bytes}
    try:
        pool = eng.prefill_pool.stats()
    except Exception as exc:
        counters["pool_available"] = 0
        pool_error = repr(exc)
    else:
        counters.update({"pool_available": 1, "pool_used_bytes": pool.used_bytes, "pool_used_blocks": pool.used_blocks,
                         "pool_live_leases": pool.live_leases, "pool_complete_objects": pool.complete_objects})
        pool_error = ""
    return StatsSnapshot(counters, {"mode": "offload-only", "plan": eng.prefill.plan.log_line(),
                                    "pool_error": pool_error}, "")


def _settings(args: argparse.Namespace, layout) -> PrefillSettings:
    """The node's configs as users write them: a P/D prefill (MultiConnector with
    SfaRemoteD2HConnector), or offload-only (AscendStoreConnector alone, ``settings.d2h`` None);
    ConfigError names what is wrong."""
    settings = prefill_settings(args.kv_transfer_config, args.additional_config, layout, tp=args.tensor_parallel_size)
    if settings.d2h is not None:
        vllm_only = settings.d2h.vllm_only_problems()
        if vllm_only:
            raise ConfigError(vllm_only)
    require_available(backend=settings.store.backend,
                      transfer_backend=settings.d2h.transfer_backend if settings.d2h else None)
    for w in settings.warnings:
        log.warning("config_warning", warning=w)
    return settings


def _pool_flags(args: argparse.Namespace, store, env: Mapping[str, str] | None = None) -> None:
    """--metastore / --host-pool-gb, or the store config's metastore / host_pool_gb; both given and
    different is an error naming both. The pool size (``args.host_pool_bytes``), by one rule:
    --host-pool-gb / host_pool_gb > ``ock.mmc.local_service.dram.size`` of the mmc-local.conf named
    by --local-config or $MMC_LOCAL_CONFIG_PATH > 1 GiB; ``args.host_pool_source`` names the winner
    and ``args.host_pool_overrides`` the sources it overrode (for the start-up log line)."""
    sources = []
    for flag, attr in (("--metastore", "metastore"), ("--host-pool-gb", "host_pool_gb")):
        given, configured = getattr(args, attr), getattr(store, attr)
        if given is not None and configured is not None and given != configured:
            raise ConfigError([f"{flag} {given} and kv_connector_extra_config.{attr} {configured!r} disagree; "
                               "give one of them"])
        setattr(args, attr, given if given is not None else configured)
        if attr == "host_pool_gb" and args.host_pool_gb is not None:
            named = flag if given is not None else f"kv_connector_extra_config.{attr}"
            sources.append((int(args.host_pool_gb * 2**30), named))
    if store.backend == "mooncake" and args.metastore is not None:
        raise ConfigError([f"--metastore {args.metastore}: applies to backend 'kvoffload' only; backend 'mooncake' "
                           "keeps its objects in the mooncake_master (kv_connector_extra_config.mooncake_master)"])
    env = os.environ if env is None else env
    args.memcache_local_config = getattr(args, "local_config", None) or env.get(LOCAL_ENV)
    if store.backend == "memcache":
        if args.metastore is not None:
            raise ConfigError([f"--metastore {args.metastore}: applies to backend 'kvoffload' only; backend "
                               "'memcache' reads its MetaService from the mmc-local.conf (--local-config or "
                               f"${LOCAL_ENV})"])
        if not args.memcache_local_config:
            raise ConfigError([f"backend 'memcache': needs the LocalService's mmc-local.conf (its "
                               "ock.mmc.meta_service_url, ock.mmc.local_service.config_store_url, protocol and "
                               f"dram.size): give --local-config or set ${LOCAL_ENV}"])
    try:
        dram = local_dram_size(getattr(args, "local_config", None), env)
    except ValueError as e:
        raise ConfigError([str(e)]) from None
    if dram is not None:
        sources.append(dram)
    sources.append((2**30, "default (1 GiB)"))
    (args.host_pool_bytes, args.host_pool_source), rest = sources[0], sources[1:-1]
    args.host_pool_overrides = [f"{name} = {size} bytes" for size, name in rest]


def _memfabric(args: argparse.Namespace, d2h) -> MemfabricTransfer | None:
    """transfer_backend "memfabric": this prefill's memfabric TransferEngine (role "Prefill", the
    config-store host, at --host); else (also offload-only: no SfaRemoteD2HConnector) None. Where
    memfabric cannot start (no Ascend driver, no wheel) a StartupError with its own reason: never
    the embedded data path."""
    if d2h is None or d2h.transfer_backend != "memfabric":
        return None
    try:
        return MemfabricTransfer.start("Prefill", args.host, device_id=d2h.memfabric_device_id,
                                       data_op=d2h.memfabric_data_op)
    except (MemfabricUnavailable, MemfabricNotInstalled, ValueError) as e:
        raise StartupError(f"transfer_backend 'memfabric': {e}") from None


def _share_layer_buffers(transfer: MemfabricTransfer, engine, worker: PrefillWorker) -> None:
    """Register the layer-buffer segment with memfabric and put the session and the segment's
    address in the layout every decode gets (LayoutMetadata.memfabric_session / _segment_address)."""
    segment = engine.buffers.segment
    address = segment.plane(0).data_ptr() - segment.plane_offsets[0]  # byte 0 of the mapping
    try:
        transfer.register(address, segment.size_bytes)
    except MemfabricUnavailable as e:
        raise StartupError(f"transfer_backend 'memfabric': {e}") from None
    worker.layout.memfabric_session = transfer.session
    worker.layout.memfabric_segment_address = address


def _host_pool(args: argparse.Namespace, store, geometry, name: str):
    """The prefill's host pool. Backend ``kvoffload``: indexed by the metastore (``--metastore``) or
    in this process. Backend ``mooncake``: a ``MooncakeHostPool`` of its own client of the
    mooncake_master (``mooncake_master``), reachable by peers at ``--host``; a master that does not
    answer within ``MOONCAKE_CONNECT_TIMEOUT_S``, or a missing wheel, is a start-up error. Backend
    ``memcache``: a ``MemcacheHostPool`` whose LocalService starts from the mmc-local.conf
    (``--local-config`` / ``$MMC_LOCAL_CONFIG_PATH``); where its data path cannot start (no Ascend
    driver), a missing wheel or a bad conf, the start-up error names the cause (never the embedded pool)."""
    if store.backend == "memcache":
        try:
            pool = MemcacheHostPool.connect(geometry, local_config=args.memcache_local_config, eviction=LRUEviction())
        except (PoolError, MemcacheUnavailable, MemcacheNotInstalled, ValueError) as e:
            raise StartupError(f"backend 'memcache': {e}") from None
        log.info("memcache_pool_connected", meta=pool.client.meta_service_url, pool=repr(pool))
        return pool
    if store.backend == "mooncake":
        try:
            pool = MooncakeHostPool.connect(store.mooncake_master, geometry, namespace=store.mooncake_namespace,
                                            eviction=LRUEviction(), store_lease_ttl_ms=store.mooncake_lease_ttl_ms,
                                            connect_timeout_s=MOONCAKE_CONNECT_TIMEOUT_S, local_hostname=args.host)
        except (PoolError, MooncakeNotInstalled) as e:
            raise StartupError(f"backend 'mooncake': {e}") from None
        log.info("mooncake_pool_connected", master=store.mooncake_master, namespace=store.mooncake_namespace,
                 pool=repr(pool))
        return pool
    if not args.metastore:
        return LocalHostPool.create(name, geometry, eviction=LRUEviction())
    return RemoteHostPool.create(args.metastore, f"prefill-{args.host}:{args.port}", name, geometry, replace=True,
                                 rejoin=True)  # a restarted metastore must not retire the prefill


def _tp_ranks(args: argparse.Namespace, model, pool):
    """Ranks 1..N-1 started and joined, ``model`` sharded (None with one rank); a size the model
    cannot be sharded over is a ConfigError naming both."""
    from dsamodel.tp import check_tp_size

    from kvoffload_prefill.tp_ranks import TPRanks

    size = args.tensor_parallel_size
    if size == 1:
        return None
    try:
        check_tp_size(model.config, size)
    except ValueError as exc:
        pool.close()
        raise ConfigError([f"--tensor-parallel-size: {exc}"]) from None
    import torch

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // size))  # the ranks share this host's cores
    try:
        return TPRanks.start(model, model_dir=args.model, dtype=args.dtype, size=size, log_level=args.log_level)
    except BaseException:
        pool.close()
        raise


def _follower_buffers(ranks, engine, tag: str) -> list:
    """Each follower creates its layer buffers (``dsamodel.engine.tp_prefill``: contributor
    buffers) and rank 0 attaches them, to name them in that rank's layout and serve them to
    decodes on other hosts. On failure everything started is stopped."""
    from dsamodel.engine.buffers import LayerBuffers
    from kvcore.device import DeviceAllocator

    names = [f"kvoffload-prefill-buffers-{tag}-tp{r}" for r in range(1, ranks.size)]
    try:
        ranks.followers.buffers(engine.plan, engine.buffers.num_blocks, names)
        return [LayerBuffers(engine.plan, engine.buffers.num_blocks, DeviceAllocator(engine.model.device),
                             engine.model.dtype, segment_name=n, attach=True) for n in names]
    except BaseException:
        engine.close()
        ranks.close()
        engine.pool.close()
        raise


def _not_ready(pool) -> str:
    """Why the prefill cannot take requests now ("" when it can): its pool is not registered with
    the metastore, or the metastore does not answer; or the mooncake_master does not answer, or the
    Mooncake pool's upkeep failed (``MooncakeHostPool.not_ready``). A LocalHostPool is always ready."""
    if isinstance(pool, RemoteHostPool):
        return pool.not_ready()
    if isinstance(pool, MooncakeHostPool):
        host, _, port = pool.store.master.rpartition(":")
        if not port_answers(host, int(port), MOONCAKE_PROBE_TIMEOUT_S):
            return (f"the mooncake_master at {pool.store.master} does not answer (down or restarting): the host "
                    f"pool cannot reach Mooncake Store")
        return pool.not_ready()  # e.g. re-putting its objects after a master restart
    return ""


def _stats(worker: PrefillWorker, include_ledger: bool) -> StatsSnapshot:
    eng = worker.engine
    counters = {**eng.gates.stats(), **worker.ledger.counters(), "device_kv_bytes": eng.allocator.stats().current_bytes}
    try:
        pool = eng.pool.stats()
    except Exception as exc:  # e.g. the metastore is down or forgot the pool: Stats still answers
        counters["pool_available"] = 0
        pool_error = repr(exc)
    else:
        counters.update({"pool_available": 1, "pool_used_bytes": pool.used_bytes,
                         "pool_used_blocks": pool.used_blocks, "pool_live_leases": pool.live_leases,
                         "pool_complete_objects": pool.complete_objects})
        pool_error = ""
    return StatsSnapshot(counters, {"plan": eng.plan.log_line(), "pool_error": pool_error},
                         worker.ledger.snapshot() if include_ledger else "")


def cli() -> None:
    """The console script: ``main``, then exit at once (everything was released in order already)."""
    exit_now(main())


if __name__ == "__main__":
    cli()
