"""``--tensor-parallel-size N`` on the decode: its TP rank processes and their lifecycle.

The service process is TP rank 0: it serves HTTP, the proxy registration and its own control port,
runs the ``DecodeLoop`` over a ``LeadDecoder`` (``kvoffload_engine.tp_decode``: rank 0 decides every
admission, bind, step and free; the followers repeat them) and samples. ``TPRanks.start`` spawns
ranks 1..N-1 (``python -m kvoffload_decode.tp_ranks --rank R --init I -- <rank 0's arguments>``,
one process each; ``svcruntime.ranks``: a gloo group over a file rendezvous) and shards rank 0's
model. Each follower parses the same arguments, so it has the same model, sizes and configs, and:

- holds its shard and a ``SparseDecoder`` of its own (its indexer cache and hot buffer) over the DP
  rank's one host pool: rank 0 creates it and passes its segment's name (``--pool-segment``), the
  follower attaches it (``kvcore.pool.attached``) and takes the blocks rank 0 allocates from rank 0's
  ops, so a TP N decode holds each prompt's KV once in host memory; every rank selects the same
  top-k over the same rows;
- serves the Transfer control port of its rank, ``kv_port + dp_rank * N + rank``, where its
  contributor prefill ranks announce their shares of every layer; it pulls them into the shared
  pool (the same bytes rank 0 pulls) and its indexer cache (``kvoffload_decode.follower``), answers
  each READ_DONE / READ_FAILED itself, and its Stats show what it pulled from which prefill rank and
  the pool blocks its requests hold;
- follows rank 0 (``follow_decode``) until rank 0 closes the group.

Rank 0 runs a request only once every rank holds its prompt whole (it polls them). One service,
one lifecycle: a follower that exits makes the decode not ready (naming the rank and its exit
code) and fails its steps from then on (``TPGroupBroken``), never a silent wait.
"""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING

import structlog

from svcruntime.ranks import LeadRanks, RankProcesses, follower_parser, join_group, share_cores

if TYPE_CHECKING:  # the engine is imported where it is used (``lead``)
    from kvoffload_decode.options import DecodeConfig
    from kvoffload_engine.tp_decode import LeadDecoder

log = structlog.get_logger(__name__)


class TPRanks(LeadRanks):
    """Ranks 1..N-1 of one decode and rank 0's ``LeadDecoder`` over them."""

    def __init__(self, processes: RankProcesses) -> None:
        super().__init__(processes)
        self.decoder: LeadDecoder | None = None  # the LeadDecoder, once ``lead`` built it

    @classmethod
    def start(cls, model, *, size: int, argv: list[str], pool_segment: str) -> TPRanks:
        """Spawn ranks 1..size-1 with rank 0's ``argv`` (each attaching the pool ``pool_segment``),
        join the group and shard ``model``."""
        from dsamodel.tp import DistGroup, check_tp_size, shard_model

        check_tp_size(model.config, size)
        processes = RankProcesses.start(
            size,
            lambda r, init: [
                sys.executable,
                "-m",
                "kvoffload_decode.tp_ranks",
                "--rank",
                str(r),
                "--size",
                str(size),
                "--init",
                init,
                "--pool-segment",
                pool_segment,
                "--",
                *argv,
            ],
        )
        model = shard_model(model, DistGroup())  # a Llama model is refused: it runs on one rank
        log.info("tp_ranks_joined", size=size, pids=processes.pids)
        return cls(processes)

    def lead(self, model, pool, **decoder_kw):
        """Rank 0's ``LeadDecoder``: every rank pulls its own rows (``send_rows`` off)."""
        from kvoffload_engine.tp_channel import DistChannel
        from kvoffload_engine.tp_decode import LeadDecoder

        self.decoder = LeadDecoder(model, pool, channel=DistChannel(), size=self.size, send_rows=False, **decoder_kw)
        self.watch()
        return self.decoder

    def broken(self) -> str:
        return self.decoder.broken if self.decoder is not None else ""

    def mark_broken(self, why: str) -> None:
        assert self.decoder is not None, "watched only once ``lead`` built the decoder"
        self.decoder.mark_broken(why)

    def followers_closer(self):
        return self.decoder.close_followers if self.decoder is not None and not self.decoder.broken else None


def _follower_main(argv: list[str] | None = None) -> int:
    """One follower rank (module doc)."""
    import torch.distributed as dist

    from dsamodel.tp import DistGroup, shard_model
    from dsamodel.weights import load_model
    from kvcore.pool.attached import AttachedPool
    from kvoffload_decode.options import SERVICE, config_of
    from kvoffload_engine.decode import SparseDecoder
    from kvoffload_engine.model_layout import kv_layout
    from svcruntime import tls as kvtls
    from svcruntime.logs import configure_logging

    own, args = _parse_rank_args(argv)
    configure_logging(f"{SERVICE}-tp{own.rank}", args.log_level)
    tls = kvtls.from_args(args, serving=f"{SERVICE}-tp{own.rank}")
    kvtls.configure(tls)
    share_cores(own.size)
    model = load_model(args.model, dtype=args.dtype)
    join_group(own.init, own.rank, own.size)
    model = shard_model(model, DistGroup())  # a Llama model is refused: it runs on one rank
    layout = kv_layout(model.config, args.block_size, model.dtype)
    cfg = config_of(args, layout, model.config.index_topk)
    control_port = cfg.settings.control_port(cfg.dp_rank, own.rank)
    pool = AttachedPool.attach(own.pool_segment)
    try:
        decoder = SparseDecoder(model, pool, **cfg.decoder_options())
        steps = _follow(decoder, pool, layout, own, cfg, tls, control_port)
        dist.destroy_process_group()
        log.info("tp_rank_closed", rank=own.rank, steps=steps)
    finally:
        pool.close()
    return 0


def _parse_rank_args(argv: list[str] | None) -> tuple[argparse.Namespace, argparse.Namespace]:
    """This rank's own flags (``--rank``, ``--size``, ``--init``, ``--pool-segment``) and rank 0's
    service arguments, which follow them (after ``--``)."""
    from kvoffload_decode.options import build_parser

    p = follower_parser("kvoffload-decode tp rank")
    p.add_argument("--pool-segment", required=True, help="rank 0's host pool segment, attached here")
    p.add_argument("service_args", nargs=argparse.REMAINDER)
    own = p.parse_args(argv)
    args = build_parser().parse_args(own.service_args[1:] if own.service_args[:1] == ["--"] else own.service_args)
    return own, args


def _follow(decoder, pool, layout, own: argparse.Namespace, cfg: DecodeConfig, tls, control_port: int) -> int:
    """Serve this rank's control port (its pulls into ``decoder``) and follow rank 0 until it closes
    the group; returns the steps run."""
    from kvcore.pool.segment import host_id
    from kvoffload_decode import __version__
    from kvoffload_decode.follower import FollowerPulls
    from kvoffload_decode.options import SERVICE
    from kvoffload_decode.transfer import decode_transfer
    from kvoffload_engine.tp_channel import DistChannel
    from kvoffload_engine.tp_decode import follow_decode
    from kvoffload_proto.v1 import transfer_pb2_grpc
    from svcruntime.serving import GrpcSide, StatsSnapshot

    pulls = FollowerPulls(decoder, own.rank)
    transfer = decode_transfer(
        pulls,
        layout,
        cfg.model_id,
        host_id(),
        read_retries=cfg.read_retries,
        tls=tls,
        tp_rank=own.rank,
        tp_size=own.size,
    )

    def stats(include_ledger: bool) -> StatsSnapshot:
        used = pool.stats()
        return StatsSnapshot(
            {
                **transfer.counters,
                "pool_used_bytes": used.used_bytes,
                "pool_used_blocks": used.used_blocks,
                "pool_live_leases": used.live_leases,
                "sequences": len(decoder.seqs),
            }
        )

    grpc_side = GrpcSide(
        f"{SERVICE}-tp{own.rank}",
        __version__,
        stats,
        workers=16,
        options=[("grpc.max_receive_message_length", 8 << 20)],
    )
    grpc_side.add(transfer_pb2_grpc.add_TransferServicer_to_server, transfer)
    grpc_side.add_port(f"{cfg.host}:{control_port}", tls)
    grpc_side.start()
    log.info("tp_rank_following", rank=own.rank, size=own.size, control_port=control_port)
    try:
        return follow_decode(decoder, DistChannel(), pulls.lock, on_op=pulls.on_op, status=pulls.status)
    finally:
        grpc_side.stop(1.0)
        transfer.close()


if __name__ == "__main__":
    sys.exit(_follower_main())
