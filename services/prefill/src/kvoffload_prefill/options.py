"""The prefill's command line and what it gives: the flags (``build_parser``), their checks, and the
one validated ``PrefillConfig`` the serving code reads (``config_of``: the node's settings,
``settings_of``, and the host pool's flags resolved against the store config, ``pool_flags``)."""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import structlog

from kvcore.backends import require_available
from kvcore.config.errors import ConfigError
from kvcore.config.mmc_files import LOCAL_ENV, mmc_pair
from kvcore.config.prefill_settings import PrefillSettings, prefill_settings
from kvcore.pool.registry import EMBEDDED, POOL_BACKENDS
from kvoffload_prefill import __version__
from kvoffload_prefill.queue_bound import DEFAULT_MAX_QUEUE_WAIT_S, MAX_IN_SERVICE
from svcruntime.flags import add_model_service_flags, add_process_flags, add_shared_flag

DESCRIPTION = "``kvoffload-prefill``: the kv_producer. Takes ``--kv-transfer-config`` as users write it:"
SERVICE = "kvoffload-prefill"
FLAG_RULES = dict(
    at_least_one=("max_model_len", "block_size", "chunk_size", "max_num_seqs", "tensor_parallel_size"),
    seconds=("host_pool_gb", "read_timeout_s", "peer_timeout_s"),
    seconds_or_zero=("shutdown_grace_s", "max_queue_wait_s"),
    ports=("port",),
    any_ports=("data_port",),
)
log = structlog.get_logger(__name__)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=SERVICE, description=DESCRIPTION)
    add_model_service_flags(p, __version__, port=8100, peer="decode")
    p.add_argument("--data-port", type=int, default=0, help="gRPC LayerSource/Health/Stats port (0: any free)")
    p.add_argument("--kv-transfer-config", required=True, help="AscendStoreConnector or MultiConnector JSON")
    p.add_argument("--additional-config", help="must not enable sparse_kv_offload_config")
    add_shared_flag(p, "--max-model-len")
    add_shared_flag(p, "--block-size")
    p.add_argument("--chunk-size", type=int, default=2048)
    p.add_argument(
        "--host-pool-gb",
        type=float,
        help="host KV pool (prefix cache) this node contributes, GiB (default: the store config's "
        "host_pool_gb, else ock.mmc.local_service.dram.size of --local-config, else 1)",
    )
    p.add_argument(
        "--local-config",
        help="mmc-local.conf whose ock.mmc.local_service.dram.size sizes the host "
        "pool when neither --host-pool-gb nor host_pool_gb is given; with backend "
        "memcache also the LocalService's conf, required "
        "(default: $MMC_LOCAL_CONFIG_PATH)",
    )
    p.add_argument(
        "--metastore",
        metavar="HOST:PORT",
        help="kvoffload-metastore that indexes the pool (default: the store config's metastore); "
        "without either the index is kept in this process",
    )
    p.add_argument("--read-timeout-s", type=float, default=60.0, help="longest wait for a decode's READ_DONE")
    p.add_argument(
        "--max-queue-wait-s",
        type=float,
        help="P/D mode: longest a request waits for the engine behind other prompts: one the queued prompt "
        "tokens and the measured rate say would wait longer is refused at once, one that did is refused "
        f"then, each with 429 and Retry-After; at most {MAX_IN_SERVICE} requests in service "
        f"(default {DEFAULT_MAX_QUEUE_WAIT_S:g}; 0: no bound)",
    )
    add_shared_flag(
        p,
        "--peer-timeout-s",
        help="a decode that answers no heartbeat for this long is gone: its reads fail (default 10)",
    )
    add_shared_flag(
        p, "--max-num-seqs", help="offload-only mode (no SfaRemoteD2HConnector): requests decoded together (default 8)"
    )
    add_shared_flag(p, "--dtype")
    add_shared_flag(
        p,
        "--tensor-parallel-size",
        help="TP ranks (default 1): this process is rank 0 and starts ranks 1..N-1 (gloo); attention "
        "heads and the MLP are sharded over them; N must divide the model's heads and intermediate",
    )
    add_process_flags(p)
    return p


def settings_of(args: argparse.Namespace, layout) -> PrefillSettings:
    """The node's configs as users write them: a P/D prefill (MultiConnector with
    SfaRemoteD2HConnector), or offload-only (AscendStoreConnector alone, ``settings.d2h`` None);
    ConfigError names what is wrong."""
    settings = prefill_settings(args.kv_transfer_config, args.additional_config, layout, tp=args.tensor_parallel_size)
    if settings.d2h is not None:
        vllm_only = settings.d2h.vllm_only_problems()
        if vllm_only:
            raise ConfigError(vllm_only)
    require_available(
        backend=settings.store.backend, transfer_backend=settings.d2h.transfer_backend if settings.d2h else None
    )
    for w in settings.warnings:
        log.warning("config_warning", warning=w)
    return settings


@dataclass(frozen=True)
class PoolFlags:
    """The host pool's flags resolved against the store config (``pool_flags``)."""

    metastore: str | None  # the pool's index; None: kept in this process (or the backend's own)
    metastore_source: str | None  # where ``metastore`` came from, for the start-up log
    host_pool_gb: float | None  # --host-pool-gb or host_pool_gb
    host_pool_bytes: int  # the pool's size, by the one precedence rule
    host_pool_source: str  # what set it
    host_pool_overrides: tuple[str, ...]  # the sources it overrode ("<source> = <bytes> bytes")
    pool_local_config: str | None  # the mmc-local.conf (--local-config or $MMC_LOCAL_CONFIG_PATH)
    mmc_protocol: str | None  # that file's protocol, for the log


def pool_flags(args: argparse.Namespace, store, env: Mapping[str, str] | None = None) -> PoolFlags:
    """--metastore / --host-pool-gb, or the store config's metastore / host_pool_gb; both given and
    different is an error naming both. The pool size, by one rule: --host-pool-gb / host_pool_gb >
    ``ock.mmc.local_service.dram.size`` of the mmc-local.conf named by --local-config or
    $MMC_LOCAL_CONFIG_PATH > 1 GiB (``host_pool_source`` names the winner, ``host_pool_overrides`` the
    sources it overrode). A backend that keeps its index elsewhere refuses --metastore, and one that
    needs an mmc-local.conf (``kvcore.pool.registry``) must get one. The mmc files are checked as a
    pair (``kvcore.config.mmc_files.mmc_pair``; the mmc-meta.conf of $MMC_META_CONFIG_PATH), and the embedded
    pool's index is the mmc-local.conf's ``ock.mmc.meta_service_url`` when neither --metastore nor the
    store config names one (``metastore_source`` says which)."""
    sources, named, value = [], {}, {}
    for flag, attr in (("--metastore", "metastore"), ("--host-pool-gb", "host_pool_gb")):
        given, configured = getattr(args, attr), getattr(store, attr)
        if given is not None and configured is not None and given != configured:
            raise ConfigError(
                [f"{flag} {given} and kv_connector_extra_config.{attr} {configured!r} disagree; give one of them"]
            )
        value[attr] = given if given is not None else configured
        named[attr] = flag if given is not None else f"kv_connector_extra_config.{attr}"
    metastore, host_pool_gb = value["metastore"], value["host_pool_gb"]
    if host_pool_gb is not None:
        sources.append((int(host_pool_gb * 2**30), named["host_pool_gb"]))
    backend = POOL_BACKENDS[store.backend]
    if backend.index and metastore is not None:
        raise ConfigError(
            [f"--metastore {metastore}: applies to backend {EMBEDDED!r} only; backend {backend.name!r} {backend.index}"]
        )
    env = os.environ if env is None else env
    local_config = getattr(args, "local_config", None) or env.get(LOCAL_ENV)
    if backend.local_config and not local_config:
        raise ConfigError(
            [f"backend {backend.name!r}: {backend.local_config}: give --local-config or set ${LOCAL_ENV}"]
        )
    try:
        pair = mmc_pair(None, local_config, env)
        dram = pair.dram_size()
    except ValueError as e:
        raise ConfigError([str(e)]) from None
    metastore_source = named["metastore"] if metastore is not None else None
    if metastore is None and backend.name == EMBEDDED and pair.metastore is not None:
        metastore, metastore_source = pair.metastore, pair.meta_service_where
    if dram is not None:
        sources.append(dram)
    sources.append((2**30, "default (1 GiB)"))
    (size, source), rest = sources[0], sources[1:-1]
    return PoolFlags(
        metastore,
        metastore_source,
        host_pool_gb,
        size,
        source,
        tuple(f"{name} = {n} bytes" for n, name in rest),
        local_config,
        pair.protocol,
    )


@dataclass(frozen=True)
class PrefillConfig:
    """Everything the prefill serves by, validated once at start-up (``config_of``): its flags, the
    node's settings (``--kv-transfer-config``, ``--additional-config``) and the pool's resolved flags.
    The serving code reads this, never the command line."""

    host: str
    port: int
    data_port: int
    model: str
    model_id: str  # --served-model-name, else the model directory's name
    dtype: str
    max_model_len: int
    block_size: int
    chunk_size: int
    max_num_seqs: int
    tensor_parallel_size: int
    read_timeout_s: float
    peer_timeout_s: float
    max_queue_wait_s: float | None
    shutdown_grace_s: float
    log_level: str
    settings: PrefillSettings
    pool: PoolFlags


def config_of(args: argparse.Namespace, layout, env: Mapping[str, str] | None = None) -> PrefillConfig:
    """The prefill's ``PrefillConfig`` from its parsed flags and the model's KV ``layout``;
    ConfigError names what is wrong."""
    settings = settings_of(args, layout)
    return PrefillConfig(
        host=args.host,
        port=args.port,
        data_port=args.data_port,
        model=args.model,
        model_id=args.served_model_name or Path(args.model).resolve().name,
        dtype=args.dtype,
        max_model_len=args.max_model_len,
        block_size=args.block_size,
        chunk_size=args.chunk_size,
        max_num_seqs=args.max_num_seqs,
        tensor_parallel_size=args.tensor_parallel_size,
        read_timeout_s=args.read_timeout_s,
        peer_timeout_s=args.peer_timeout_s,
        max_queue_wait_s=args.max_queue_wait_s,
        shutdown_grace_s=args.shutdown_grace_s,
        log_level=args.log_level,
        settings=settings,
        pool=pool_flags(args, settings.store, env),
    )
