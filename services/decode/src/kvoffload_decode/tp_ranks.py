"""``--tensor-parallel-size N`` on the decode: its TP rank processes and their lifecycle.

The service process is TP rank 0: it serves HTTP, the proxy registration and its own control port,
runs the ``DecodeLoop`` over a ``LeadDecoder`` (``dsamodel.engine.tp_decode``: rank 0 decides every
admission, bind, step and free; the followers repeat them) and samples. ``TPRanks.start`` spawns
ranks 1..N-1 (``python -m kvoffload_decode.tp_ranks --rank R --init I -- <rank 0's arguments>``,
one process each; ``svcruntime.ranks``: a gloo group over a file rendezvous) and shards rank 0's
model. Each follower parses the same arguments, so it has the same model, sizes and configs, and:

- holds its shard and a whole ``SparseDecoder`` of its own (its own host pool, indexer cache and
  hot buffer: every rank selects the same top-k over the same rows);
- serves the Transfer control port of its rank, ``kv_port + dp_rank * N + rank``, where its
  contributor prefill ranks announce their shares of every layer; it pulls them into its own pool
  (``kvoffload_decode.follower``) and answers each READ_DONE / READ_FAILED itself, and its Stats
  show what it pulled from which prefill rank;
- follows rank 0 (``follow_decode``) until rank 0 closes the group.

Rank 0 runs a request only once every rank holds its prompt whole (it polls them). One service,
one lifecycle: a follower that exits makes the decode not ready (naming the rank and its exit
code) and fails its steps from then on (``TPGroupBroken``), never a silent wait.
"""

from __future__ import annotations

import argparse
import os
import sys
from datetime import timedelta

import structlog
from svcruntime.ranks import RankProcesses

log = structlog.get_logger(__name__)

JOIN_TIMEOUT_S = 300.0  # every rank loaded its model and joined the group within this
COLLECTIVE_TIMEOUT_S = 600.0  # a follower waits this long for rank 0's next op or reduction


class TPRanks:
    """Ranks 1..N-1 of one decode and rank 0's ``LeadDecoder`` over them."""

    def __init__(self, processes: RankProcesses) -> None:
        self.size, self.processes = processes.size, processes
        self.decoder = None  # the LeadDecoder, once ``lead`` built it

    @classmethod
    def start(cls, model, *, size: int, argv: list[str]) -> TPRanks:
        """Spawn ranks 1..size-1 with rank 0's ``argv``, join the group and shard ``model``."""
        from dsamodel.tp import DistGroup, check_tp_size, shard_model

        check_tp_size(model.config, size)
        processes = RankProcesses.start(
            size, lambda r, init: [sys.executable, "-m", "kvoffload_decode.tp_ranks", "--rank", str(r),
                                   "--size", str(size), "--init", init, "--", *argv],
            join_timeout_s=JOIN_TIMEOUT_S)
        shard_model(model, DistGroup())
        log.info("tp_ranks_joined", size=size, pids=processes.pids)
        return cls(processes)

    def lead(self, model, pool, **decoder_kw):
        """Rank 0's ``LeadDecoder``: every rank pulls its own rows (``send_rows`` off)."""
        from dsamodel.engine.tp_channel import DistChannel
        from dsamodel.engine.tp_decode import LeadDecoder

        self.decoder = LeadDecoder(model, pool, channel=DistChannel(), size=self.size, send_rows=False, **decoder_kw)
        self.processes.watch(lambda rank, pid, code: self.decoder.mark_broken(
            f"TP rank {rank} (pid {pid}) exited with code {code}"))
        return self.decoder

    def not_ready(self) -> str:
        broken = self.decoder.broken if self.decoder is not None else ""
        return f"tensor parallel group: {broken}" if broken else ""

    def close(self, timeout_s: float = 10.0) -> None:
        """Tell the followers to return, wait for them (killing any that does not end in time)."""
        whole = self.decoder is not None and not self.decoder.broken
        if whole:
            try:
                self.decoder.close_followers()
            except Exception as exc:  # a follower gone at the last moment: they are killed below
                log.warning("tp_close_failed", error=repr(exc))
                whole = False
        codes = self.processes.stop(group_whole=whole, timeout_s=timeout_s)
        log.info("tp_ranks_closed", size=self.size, exit_codes=codes)


def _follower_main(argv: list[str] | None = None) -> int:
    """One follower rank (module doc)."""
    import torch
    import torch.distributed as dist
    from dsamodel.engine import build
    from dsamodel.engine.decode import SparseDecoder
    from dsamodel.engine.layout import kv_layout
    from dsamodel.engine.tp_channel import DistChannel
    from dsamodel.engine.tp_decode import follow_decode
    from dsamodel.tp import DistGroup, shard_model
    from dsamodel.weights import load_model
    from kvcore.segment import host_id
    from kvoffload_proto.v1 import transfer_pb2_grpc
    from svcruntime import tls as kvtls
    from svcruntime.logs import configure_logging
    from svcruntime.serving import GrpcSide, StatsSnapshot

    from kvoffload_decode import __version__
    from kvoffload_decode.follower import FollowerPulls
    from kvoffload_decode.options import SERVICE, build_parser, decoder_options, model_id_of, settings_of
    from kvoffload_decode.transfer import TransferServicer

    p = argparse.ArgumentParser(prog="kvoffload-decode tp rank")
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--size", type=int, required=True)
    p.add_argument("--init", required=True)
    p.add_argument("service_args", nargs=argparse.REMAINDER)
    own = p.parse_args(argv)
    args = build_parser().parse_args(own.service_args[1:] if own.service_args[:1] == ["--"] else own.service_args)
    configure_logging(f"{SERVICE}-tp{own.rank}", args.log_level)
    tls = kvtls.from_args(args, serving=f"{SERVICE}-tp{own.rank}")
    kvtls.configure(tls)
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // own.size))
    model = load_model(args.model, dtype=args.dtype)
    dist.init_process_group("gloo", init_method=own.init, rank=own.rank, world_size=own.size,
                            timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S))
    shard_model(model, DistGroup())
    layout = kv_layout(model.config, args.block_size, model.dtype)
    settings = settings_of(args, layout, model.config.index_topk)
    control_port = settings.control_port(args.dp_rank, own.rank)
    pool = build.decode_pool(model, args.block_size, settings.host_pool_bytes,
                             name=f"kvoffload-decode-{control_port}-tp{own.rank}")
    try:
        decoder = SparseDecoder(model, pool, **decoder_options(args, settings))
        pulls = FollowerPulls(decoder, own.rank)
        transfer = TransferServicer(pulls, layout, model_id_of(args), host_id(), model.dtype,
                                    read_retries=args.read_retries, tls=tls, tp_rank=own.rank, tp_size=own.size)

        def stats(include_ledger: bool) -> StatsSnapshot:
            used = pool.stats()
            return StatsSnapshot({**transfer.counters, "pool_used_bytes": used.used_bytes,
                                  "pool_used_blocks": used.used_blocks, "pool_live_leases": used.live_leases,
                                  "sequences": len(decoder.seqs)})

        grpc_side = GrpcSide(f"{SERVICE}-tp{own.rank}", __version__, stats, workers=16,
                             options=[("grpc.max_receive_message_length", 8 << 20)])
        grpc_side.add(transfer_pb2_grpc.add_TransferServicer_to_server, transfer)
        grpc_side.add_port(f"{args.host}:{control_port}", tls)
        grpc_side.start()
        log.info("tp_rank_following", rank=own.rank, size=own.size, control_port=control_port)
        try:
            steps = follow_decode(decoder, DistChannel(), pulls.lock, on_op=pulls.on_op, status=pulls.status)
        finally:
            grpc_side.stop(1.0)
            transfer.close()
        dist.destroy_process_group()
        log.info("tp_rank_closed", rank=own.rank, steps=steps)
    finally:
        pool.close()
    return 0


if __name__ == "__main__":
    sys.exit(_follower_main())
