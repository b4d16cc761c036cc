"""The decode's command line and what it gives: the flags (``build_parser``), their checks, and the
one validated ``DecodeConfig`` the serving code reads (``config_of``: the node's settings and the
``SparseDecoder`` options). One place, so that every TP rank of a decode
(``kvoffload_decode.tp_ranks``: each parses rank 0's arguments) builds exactly what rank 0 builds."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

import structlog

from kvcore.backends import require_available
from kvcore.config.decode_settings import DecodeSettings, decode_settings
from kvcore.config.errors import ConfigError
from kvcore.transferregistry import uses_engine
from kvoffload_decode import __version__
from kvoffload_decode.loop import DEFAULT_STEP_GATHER_S
from kvoffload_decode.queue_wait import DEFAULT_MAX_QUEUE_WAIT_S
from svcruntime.flags import add_model_service_flags, add_process_flags, add_shared_flag

DESCRIPTION = "``kvoffload-decode``: the kv_consumer (sparse-offload decode of a P/D stack)."
SERVICE = "kvoffload-decode"
FLAG_RULES = dict(
    at_least_one=("max_model_len", "max_num_seqs", "block_size", "tensor_parallel_size"),
    at_least_zero=("dp_rank", "read_retries", "max_queued_requests"),
    seconds=("metaserver_timeout_s", "peer_timeout_s"),
    seconds_or_zero=("shutdown_grace_s", "step_gather_ms", "max_queue_wait_s"),
    ports=("port",),
)
log = structlog.get_logger(__name__)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=SERVICE, description=DESCRIPTION)
    add_model_service_flags(p, __version__, port=8200, peer="prefill")
    p.add_argument("--kv-transfer-config", required=True, help="SfaRemoteD2HConnector kv_consumer JSON")
    p.add_argument("--additional-config", help="JSON with sparse_kv_offload_config")
    add_shared_flag(p, "--max-model-len")
    add_shared_flag(p, "--max-num-seqs")
    add_shared_flag(p, "--block-size")
    p.add_argument("--dp-rank", type=int, default=0)
    add_shared_flag(
        p,
        "--tensor-parallel-size",
        help="TP ranks: this process is rank 0 and starts ranks 1..N-1 on this host, each with its own "
        "control port (kv_port + dp_rank*N + rank), pool and shard of the model (default 1)",
    )
    add_shared_flag(p, "--dtype")
    p.add_argument("--metaserver-timeout-s", type=float, default=600.0)
    add_shared_flag(
        p, "--peer-timeout-s", help="fail a request whose prefill sent no heartbeat or data for this long (default 10)"
    )
    p.add_argument("--read-retries", type=int, default=2, help="retries of a failed layer read (default 2)")
    p.add_argument(
        "--max-queued-requests",
        type=int,
        default=0,
        help="requests admitted but not yet in the running batch; one more gets 429 with Retry-After "
        "at once (default 0: as many as the host pool holds at max_model_len/4 tokens each, "
        "at least 4 x --max-num-seqs, at most 1024)",
    )
    p.add_argument(
        "--max-queue-wait-s",
        type=float,
        default=DEFAULT_MAX_QUEUE_WAIT_S,
        help="longest a request waits in this decode's queues (for host blocks, or for a sequence slot once "
        "its prompt is complete; its prefill is service, not a wait): one the queue's measured pace says "
        "would wait longer is refused at once, one that did is refused then, each with 429 and Retry-After "
        f"(default {DEFAULT_MAX_QUEUE_WAIT_S:g}; 0: no bound)",
    )
    p.add_argument(
        "--step-gather-ms",
        type=float,
        default=DEFAULT_STEP_GATHER_S * 1000,
        help="at saturation (more admitted requests still being prefilled or pulled than the batch has "
        "room for), hold the next step up to this long after the previous one began, so they join "
        f"it (default {DEFAULT_STEP_GATHER_S * 1000:g}; 0: step at once; below saturation it never waits)",
    )
    p.add_argument(
        "--speculative-config",
        metavar="JSON",
        help='MTP speculative decoding, vLLM\'s format: {"method": "deepseek_mtp", '
        '"num_speculative_tokens": 1} (greedy requests; the model needs an MTP layer)',
    )
    add_process_flags(p)
    return p


@dataclass(frozen=True)
class DecodeConfig:
    """Everything a decode rank serves by, validated once at start-up (``config_of``): its flags and
    the node's settings (``--kv-transfer-config``, ``--additional-config``). The serving code reads
    this, never the command line; every TP rank builds the same one from rank 0's arguments."""

    host: str
    port: int
    model: str
    model_id: str  # --served-model-name, else the model directory's name
    block_size: int
    max_model_len: int
    max_num_seqs: int
    dp_rank: int
    peer_timeout_s: float
    max_queued_requests: int | None  # None: no bound
    step_gather_s: float
    max_queue_wait_s: float  # 0: no bound
    read_retries: int
    metaserver_timeout_s: float
    shutdown_grace_s: float
    settings: DecodeSettings

    def decoder_options(self) -> dict:
        """The ``SparseDecoder`` keywords these flags and configs give (every TP rank builds the same)."""
        sparse = self.settings.sparse
        return dict(
            topk_buffer_size=sparse.topk_buffer_size,
            max_num_seqs=self.max_num_seqs,
            max_model_len=self.max_model_len,
            keep_device_kv_cache=sparse.keep_device_kv_cache,
            hot_cache_policy=sparse.hot_cache_policy,
            miss_prefetch=sparse.miss_prefetch,
        )


def config_of(args: argparse.Namespace, layout, index_topk: int | None) -> DecodeConfig:
    """The decode's ``DecodeConfig`` from its parsed flags and the model's KV ``layout``; ConfigError
    names what is wrong."""
    return DecodeConfig(
        host=args.host,
        port=args.port,
        model=args.model,
        model_id=args.served_model_name or Path(args.model).resolve().name,
        block_size=args.block_size,
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        dp_rank=args.dp_rank,
        peer_timeout_s=args.peer_timeout_s,
        max_queued_requests=args.max_queued_requests or None,
        step_gather_s=args.step_gather_ms / 1000,
        max_queue_wait_s=args.max_queue_wait_s,
        read_retries=args.read_retries,
        metaserver_timeout_s=args.metaserver_timeout_s,
        shutdown_grace_s=args.shutdown_grace_s,
        settings=settings_of(args, layout, index_topk),
    )


def settings_of(args: argparse.Namespace, layout, index_topk: int | None) -> DecodeSettings:
    """The node's configs as users write them, for this decode; ConfigError names what is wrong."""
    if args.tensor_parallel_size < 1:
        raise ConfigError([f"--tensor-parallel-size: got {args.tensor_parallel_size}; must be an int >= 1"])
    settings = decode_settings(
        args.kv_transfer_config,
        args.additional_config,
        layout,
        index_topk=index_topk,
        max_num_seqs=args.max_num_seqs,
        max_model_len=args.max_model_len,
        dp=args.dp_rank + 1,
        tp=args.tensor_parallel_size,
    )
    vllm_only = settings.d2h.vllm_only_problems()
    if vllm_only:
        raise ConfigError(vllm_only)
    if settings.tp > 1 and uses_engine(settings.d2h.transfer_backend):
        raise ConfigError(
            [
                f"--tensor-parallel-size: got {settings.tp}; with transfer_backend "
                f"{settings.d2h.transfer_backend!r} the decode runs one rank, use 1"
            ]
        )
    require_available(transfer_backend=settings.d2h.transfer_backend)
    for w in settings.warnings:
        log.warning("config_warning", warning=w)
    return settings
