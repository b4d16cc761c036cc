"""``--tensor-parallel-size N``: the prefill's TP rank processes and their lifecycle.

The service process is TP rank 0: it serves HTTP and gRPC, owns the pool and the layer buffers and
runs the engine (``kvoffload_engine.tp_prefill``: rank 0 leads). ``TPRanks.start`` spawns ranks
1..N-1 (``python -m kvoffload_prefill.tp_ranks``, one process each, same model and dtype), joins
them in a gloo group (``svcruntime.ranks``: a file rendezvous in a private directory; loopback TCP
between them) and shards rank 0's model; each follower loads the model, keeps its shard and follows rank 0 until it
closes the group. One service, one lifecycle: the followers die with rank 0 (they are told to close
on shutdown, and a follower whose rank 0 is gone fails its next collective), and a follower that
exits while rank 0 runs makes the prefill not ready (``not_ready``), naming the rank and its exit
code, and fails requests from then on (``TPGroupBroken``) instead of waiting on it.
"""

from __future__ import annotations

import sys

import structlog

from svcruntime.ranks import LeadRanks, RankProcesses, follower_parser, join_group, share_cores

log = structlog.get_logger(__name__)


class TPRanks(LeadRanks):
    """Ranks 1..N-1 of one prefill (``svcruntime.ranks.RankProcesses``) and rank 0's ``Followers``."""

    def __init__(self, processes: RankProcesses) -> None:
        from kvoffload_engine.tp_channel import DistChannel
        from kvoffload_engine.tp_prefill import Followers

        super().__init__(processes)
        self.followers = Followers(DistChannel(), processes.size)
        self.watch()

    @classmethod
    def start(cls, model, *, model_dir: str, dtype: str | None, size: int, log_level: str) -> TPRanks:
        """Spawn ranks 1..size-1, join the group as rank 0 and shard ``model`` (in place)."""
        from dsamodel.tp import DistGroup, check_tp_size, shard_model

        check_tp_size(model.config, size)
        processes = RankProcesses.start(
            size,
            lambda r, init: [
                sys.executable,
                "-m",
                "kvoffload_prefill.tp_ranks",
                "--model",
                model_dir,
                "--rank",
                str(r),
                "--size",
                str(size),
                "--init",
                init,
                "--log-level",
                log_level,
                *(["--dtype", dtype] if dtype else []),
            ],
        )
        model = shard_model(model, DistGroup())  # a Llama model is refused: it runs on one rank
        log.info("tp_ranks_joined", size=size, pids=processes.pids)
        return cls(processes)

    def broken(self) -> str:
        return self.followers.broken

    def mark_broken(self, why: str) -> None:
        if not self.followers.broken:
            self.followers.broken = why

    def followers_closer(self):
        return None if self.followers.broken else self.followers.close


def _follower_main(argv: list[str] | None = None) -> int:
    """One follower rank: load the model, join the group, keep the shard, follow rank 0."""
    import torch.distributed as dist

    from dsamodel.tp import DistGroup, shard_model
    from dsamodel.weights import load_model
    from kvoffload_engine.tp_channel import DistChannel
    from kvoffload_engine.tp_prefill import follow
    from svcruntime.logs import configure_logging

    p = follower_parser("kvoffload-prefill tp rank")
    p.add_argument("--model", required=True)
    p.add_argument("--dtype")
    p.add_argument("--log-level", default="info")
    args = p.parse_args(argv)
    configure_logging(f"kvoffload-prefill-tp{args.rank}", args.log_level)
    share_cores(args.size)
    model = load_model(args.model, dtype=args.dtype)
    join_group(args.init, args.rank, args.size)
    model = shard_model(model, DistGroup())  # a Llama model is refused: it runs on one rank
    log.info("tp_rank_following", rank=args.rank, size=args.size)
    chunks = follow(model, DistChannel())
    dist.destroy_process_group()
    log.info("tp_rank_closed", rank=args.rank, chunks=chunks)
    return 0


if __name__ == "__main__":
    sys.exit(_follower_main())
