"""``--tensor-parallel-size N``: the prefill's TP rank processes and their lifecycle.

The service process is TP rank 0: it serves HTTP and gRPC, owns the pool and the layer buffers and
runs the engine (``dsamodel.engine.tp_prefill``: rank 0 leads). ``TPRanks.start`` spawns ranks
1..N-1 (``python -m kvoffload_prefill.tp_ranks``, one process each, same model and dtype), joins
them in a gloo group (a file rendezvous in a private directory; loopback TCP between them) and
shards rank 0's model; each follower loads the model, keeps its shard and follows rank 0 until it
closes the group. One service, one lifecycle: the followers die with rank 0 (they are told to close
on shutdown, and a follower whose rank 0 is gone fails its next collective), and a follower that
exits while rank 0 runs makes the prefill not ready (``not_ready``), naming the rank and its exit
code, and fails requests from then on (``TPGroupBroken``) instead of waiting on it.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import threading
from datetime import timedelta

import structlog

log = structlog.get_logger(__name__)

JOIN_TIMEOUT_S = 300.0  # every rank loaded its model and joined the group within this
COLLECTIVE_TIMEOUT_S = 600.0  # a follower waits this long for rank 0's next message or reduction


class TPRanks:
    """Ranks 1..N-1 of one prefill, started and joined by ``start``; rank 0 is this process."""

    def __init__(self, size: int, procs: list[subprocess.Popen], workdir: str) -> None:
        from dsamodel.engine.tp_channel import DistChannel
        from dsamodel.engine.tp_prefill import Followers

        self.size, self._procs, self._workdir = size, procs, workdir
        self.followers = Followers(DistChannel(), size)
        self._closing = threading.Event()
        self._watch = threading.Thread(target=self._watch_ranks, name="tp-ranks", daemon=True)
        self._watch.start()

    @classmethod
    def start(cls, model, *, model_dir: str, dtype: str | None, size: int, log_level: str) -> TPRanks:
        """Spawn ranks 1..size-1, join the group as rank 0 and shard ``model`` (in place)."""
        import torch.distributed as dist

        from dsamodel.tp import DistGroup, check_tp_size, shard_model

        check_tp_size(model.config, size)
        workdir = tempfile.mkdtemp(prefix="kvoffload-prefill-tp-")
        init = f"file://{workdir}/rendezvous"
        procs = [subprocess.Popen([sys.executable, "-m", "kvoffload_prefill.tp_ranks", "--model", model_dir,
                                   "--rank", str(r), "--size", str(size), "--init", init, "--log-level", log_level,
                                   *(["--dtype", dtype] if dtype else [])])
                 for r in range(1, size)]
        try:
            _join(procs, init, size)
        except BaseException:
            for p in procs:
                p.kill()
                p.wait()
            shutil.rmtree(workdir, ignore_errors=True)
            raise
        shard_model(model, DistGroup())
        log.info("tp_ranks_joined", size=size, pids=[p.pid for p in procs])
        return cls(size, procs, workdir)

    def _watch_ranks(self) -> None:
        while not self._closing.wait(0.5):
            for rank, p in enumerate(self._procs, start=1):
                code = p.poll()
                if code is not None and not self.followers.broken:
                    self.followers.broken = f"TP rank {rank} (pid {p.pid}) exited with code {code}"
                    log.error("tp_rank_exited", rank=rank, pid=p.pid, exit_code=code)

    def not_ready(self) -> str:
        """Why the group cannot serve ("" while every rank is in step)."""
        return f"tensor parallel group: {self.followers.broken}" if self.followers.broken else ""

    def close(self, timeout_s: float = 10.0) -> None:
        """Tell the followers to return, wait for them (killing any that does not end in time)."""
        import torch.distributed as dist

        self._closing.set()
        broken = bool(self.followers.broken)
        if not broken:
            try:
                self.followers.close()
            except Exception as exc:  # a follower gone at the last moment: they are killed below
                log.warning("tp_close_failed", error=repr(exc))
                broken = True
        for p in self._procs:
            try:
                p.wait(timeout_s)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        if not broken:
            dist.destroy_process_group()
        shutil.rmtree(self._workdir, ignore_errors=True)
        log.info("tp_ranks_closed", size=self.size, exit_codes=[p.returncode for p in self._procs])


def _join(procs: list[subprocess.Popen], init: str, size: int) -> None:
    """Join the group as rank 0, watching the followers meanwhile: one that exits before it joined
    (its model did not load, say) ends the wait at once, naming its rank and exit code."""
    import torch.distributed as dist

    from svcruntime.serving import StartupError

    failed: list[BaseException] = []

    def init_group() -> None:
        try:
            dist.init_process_group("gloo", init_method=init, rank=0, world_size=size,
                                    timeout=timedelta(seconds=JOIN_TIMEOUT_S))
        except BaseException as exc:  # noqa: BLE001 - re-raised by the caller's thread
            failed.append(exc)

    joiner = threading.Thread(target=init_group, name="tp-join", daemon=True)
    joiner.start()
    while joiner.is_alive():
        joiner.join(0.2)
        for rank, p in enumerate(procs, start=1):
            code = p.poll()
            if code is not None and joiner.is_alive():
                raise StartupError(f"--tensor-parallel-size {size}: TP rank {rank} exited with code {code} "
                                   "before it joined the group (its log lines above say why)")
    if failed:
        raise StartupError(f"--tensor-parallel-size {size}: joining the TP group failed: {failed[0]!r}")


def _follower_main(argv: list[str] | None = None) -> int:
    """One follower rank: load the model, join the group, keep the shard, follow rank 0."""
    import torch
    import torch.distributed as dist
    from svcruntime.logs import configure_logging

    from dsamodel.engine.tp_channel import DistChannel
    from dsamodel.engine.tp_prefill import follow
    from dsamodel.tp import DistGroup, shard_model
    from dsamodel.weights import load_model

    p = argparse.ArgumentParser(prog="kvoffload-prefill tp rank")
    p.add_argument("--model", required=True)
    p.add_argument("--dtype")
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--size", type=int, required=True)
    p.add_argument("--init", required=True)
    p.add_argument("--log-level", default="info")
    args = p.parse_args(argv)
    configure_logging(f"kvoffload-prefill-tp{args.rank}", args.log_level)
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // args.size))
    model = load_model(args.model, dtype=args.dtype)
    dist.init_process_group("gloo", init_method=args.init, rank=args.rank, world_size=args.size,
                            timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S))
    shard_model(model, DistGroup())
    log.info("tp_rank_following", rank=args.rank, size=args.size)
    chunks = follow(model, DistChannel())
    dist.destroy_process_group()
    log.info("tp_rank_closed", rank=args.rank, chunks=chunks)
    return 0


if __name__ == "__main__":
    sys.exit(_follower_main())
